//! The full lifecycle for 1, 2 and 4 ranks: start, tasks on the same processes, rank 0's
//! result, END_RUN, and nothing left behind.

mod common;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{EventType, FlComponent, Shareable, Signal, Value};

#[test]
fn lifecycle_for_one_two_and_four_ranks() {
    for n in [1u32, 2, 4] {
        let logs = tempfile::tempdir().unwrap();
        let exec = MultiProcessExecutor::new(config(n, "Echo", serde_json::json!({}), logs.path()))
            .unwrap();
        let mut ctx = start(&exec);
        let status = exec.status();
        assert_eq!(status.phase, "ready", "n={n}");
        let pids = exec.live_pids();
        assert_eq!(pids.len(), n as usize, "n={n}: one process per rank");
        let sock = socket_path(&status.endpoint.clone().unwrap());
        let run_dir = sock.parent().unwrap().to_owned();
        // The listener closes (and its socket file goes) once the group is ready; the
        // private run directory stays until the group stops.
        let closed_by = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while sock.exists() {
            assert!(
                std::time::Instant::now() < closed_by,
                "n={n}: the listener still exists after start-up"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            run_dir.exists(),
            "run directory exists while the group runs"
        );

        for round in 0..3i64 {
            let input = Shareable::new()
                .with_meta("round", round)
                .with_blob("w", vec![round as u8; 1000]);
            let out = exec
                .run_task("train", input, &mut ctx, &Signal::new())
                .unwrap();
            assert_eq!(
                out.meta("rank"),
                Some(&Value::Int(0)),
                "rank 0's result is returned"
            );
            assert_eq!(out.meta("round"), Some(&Value::Int(round)));
            assert_eq!(&out.blob("w").unwrap()[..], &vec![round as u8; 1000][..]);
            // Rank 0's context is merged back.
            assert_eq!(ctx.get_prop("echoed_by"), Some(&Value::Int(0)));
        }
        assert_eq!(
            exec.live_pids(),
            pids,
            "n={n}: ranks stay alive across tasks"
        );

        exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
        assert_gone(&pids, "after END_RUN");
        assert!(!sock.exists(), "socket file removed");
        assert!(!run_dir.exists(), "run directory removed");
        for r in 0..n {
            let log =
                std::fs::read_to_string(logs.path().join(format!("rank-{r}/stderr.log"))).unwrap();
            assert!(
                log.contains("rank ready"),
                "rank {r}'s log file has its output: {log}"
            );
        }
    }
}
