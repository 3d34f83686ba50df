//! The launch secret reaches a rank we spawn through an inherited pipe, never its
//! environment: `/proc/PID/environ` of a live rank holds no secret, and the pipe is
//! closed once read. `RANKEXEC_LOG` is not part of the contract: it reaches the ranks.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn environ(pid: u32) -> Vec<(String, String)> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    raw.split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let e = String::from_utf8_lossy(e);
            let (k, v) = e.split_once('=').unwrap_or((&e, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn looks_like_a_secret(v: &str) -> bool {
    v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit())
}

#[test]
fn builtin_ranks_get_the_secret_by_pipe_and_the_log_filter_by_env() {
    let logs = tempfile::tempdir().unwrap();
    let filter = "info,rankexec_sub_worker=debug";
    let mut host = Reaper(
        Command::new(rankexec_bin())
            .args([
                "run",
                "-n",
                "2",
                "--task",
                "t",
                "--print-pids",
                "--component",
                "Sleep",
            ])
            .args(["--args", r#"{"secs": 120}"#, "--log-dir"])
            .arg(logs.path())
            .env("RANKEXEC_LOG", filter)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(host.0.stdout.take().unwrap()).lines();
    let pids: Vec<u32> = loop {
        let line = lines.next().expect("the host printed its pids").unwrap();
        if let Some(rest) = line.strip_prefix("pids: ") {
            break rest.split(' ').map(|p| p.parse().unwrap()).collect();
        }
    };
    // Killed on any exit of this test (the host by its Reaper).
    let _ranks = Held::new(&pids);
    assert_eq!(pids.len(), 2);
    for pid in &pids {
        let env = environ(*pid);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(
            get("RANKEXEC_SECRET"),
            None,
            "rank {pid}: no secret variable"
        );
        let hexes: Vec<&String> = env
            .iter()
            .filter(|(_, v)| looks_like_a_secret(v))
            .map(|(k, _)| k)
            .collect();
        assert!(
            hexes.is_empty(),
            "rank {pid}: secret-like values in {hexes:?}"
        );
        let fd = get("RANKEXEC_SECRET_FD").expect("the secret's descriptor is named");
        // Read and closed: the number is free or reused by something that is no pipe.
        let target = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
            .map(|t| t.display().to_string())
            .unwrap_or_else(|_| "closed".into());
        assert!(
            !target.starts_with("pipe:"),
            "rank {pid}: descriptor {fd} is still the secret pipe ({target})"
        );
        assert_eq!(get("RANKEXEC_LOG").as_deref(), Some(filter), "rank {pid}");
        eprintln!(
            "rank pid {pid}: {} variables, none secret; RANKEXEC_SECRET_FD={fd} now {target}; RANKEXEC_LOG={filter}",
            env.len()
        );
    }
    // The rank honours the filter: its own debug lines reach its stderr log.
    let log = logs.path().join("rank-0/stderr.log");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("DEBUG")) {
        assert!(
            Instant::now() < deadline,
            "rank 0 logged no DEBUG line under RANKEXEC_LOG={filter}: {:?}",
            std::fs::read_to_string(&log)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = host.0.kill();
    let _ = host.0.wait();
    assert_gone(&pids, "ranks after the host");
}
