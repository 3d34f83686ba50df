#![cfg(feature = "mpi")]
//! The mpirun launcher end to end, with the MPI data-parallel example
//! (`examples/mpi/executor.json`, `MpiDigitsTrainer`): tasks fan out to ranks that
//! all-reduce gradients and reach the stated accuracy; a rank killed under mpirun is
//! detected and named; an abort stops every rank at the same step; teardown leaves no
//! process behind (mpirun's ranks are not our children and each has its own process
//! group).
//!
//! Needs Open MPI (`mpirun`) and libclang at build time: `cargo test --features mpi`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::console::{console, output_matches};
use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::group::process::Role;
use rankexec::executor::{Dur, ExecuteError, ExecutorConfig, LauncherConfig, MultiProcessExecutor};
use rankexec::protocol::{Shareable, Signal, Value};

/// The accuracy `MpiDigitsTrainer` states for two ranks and its default arguments.
const STATED_ACCURACY: f64 = 0.95;

/// The example configuration, with this build's `rankexec`, short deadlines and logs
/// in `logs`; `--allow-run-as-root` when the tests run as root (CI containers).
fn mpi_config(logs: &Path, args: Option<serde_json::Value>) -> ExecutorConfig {
    let text = include_str!("../examples/mpi/executor.json");
    let mut c: ExecutorConfig = serde_json::from_str(text).expect("the example config parses");
    assert!(matches!(c.launcher, LauncherConfig::Mpirun { .. }));
    assert_eq!(c.worker.args, ["worker"]);
    c.worker.program = rankexec_bin().display().to_string();
    c.log_dir = Some(logs.to_owned());
    if let Some(args) = args {
        c.components[0].args = args;
    }
    if nix::unistd::geteuid().is_root()
        && let LauncherConfig::Mpirun { extra_args } = &mut c.launcher
    {
        extra_args.push("--allow-run-as-root".into());
    }
    let d = &mut c.deadlines;
    d.startup = Dur(Duration::from_secs(60));
    d.task = Dur(Duration::from_secs(120));
    d.event = Dur(Duration::from_secs(20));
    d.heartbeat_interval = Dur(Duration::from_millis(200));
    d.heartbeat_timeout = Dur(Duration::from_secs(10));
    d.abort_grace = Dur(Duration::from_secs(5));
    d.shutdown_grace = Dur(Duration::from_secs(5));
    d.term_grace = Dur(Duration::from_secs(2));
    c.restart.max_restarts = 0;
    c
}

/// The launcher's pid and the ranks' pids, by rank.
fn launcher_and_ranks(exec: &MultiProcessExecutor) -> (u32, Vec<u32>) {
    let procs = exec.status().processes;
    let launcher: Vec<u32> = procs
        .iter()
        .filter(|p| p.role == Role::Launcher)
        .map(|p| p.pid)
        .collect();
    assert_eq!(launcher.len(), 1, "one mpirun: {procs:?}");
    let mut ranks: Vec<(u32, u32)> = procs
        .iter()
        .filter_map(|p| match p.role {
            Role::ExternalRank(r) => Some((r, p.pid)),
            _ => None,
        })
        .collect();
    ranks.sort();
    assert_eq!(
        ranks.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        [0, 1],
        "two ranks reported by their hellos: {procs:?}"
    );
    for (_, pid) in &ranks {
        assert_ne!(*pid, launcher[0]);
        assert!(pid_alive(*pid));
    }
    (launcher[0], ranks.into_iter().map(|(_, p)| p).collect())
}

/// The host's log, installed once for the whole binary.
fn host_log() -> &'static LogCapture {
    static LOG: std::sync::OnceLock<LogCapture> = std::sync::OnceLock::new();
    LOG.get_or_init(LogCapture::install)
}

/// Runs `then` once the dispatcher has sent one more task to the ranks than the log
/// showed before (`sent_before` "task sent" lines), from a thread; the thread returns
/// when it ran `then`. Panics (failing the test) if no task is sent within 60 s.
fn once_task_sent<T: Send + 'static>(
    sent_before: usize,
    then: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while host_log().text().matches("task sent").count() <= sent_before {
            assert!(Instant::now() < deadline, "the task was never sent");
            std::thread::sleep(Duration::from_millis(10));
        }
        then()
    })
}

fn meta_f64(s: &Shareable, key: &str) -> f64 {
    s.meta(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{key} in {:?}", s.meta_map()))
}

fn meta_i64(s: &Shareable, key: &str) -> i64 {
    s.meta(key)
        .and_then(Value::as_i64)
        .unwrap_or_else(|| panic!("{key} in {:?}", s.meta_map()))
}

#[test]
fn mpirun_trains_to_the_stated_accuracy_and_tears_down() {
    let _serial = serial();
    host_log();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(mpi_config(logs.path(), None)).unwrap();
    let t = Instant::now();
    let mut ctx = start(&exec);
    eprintln!(
        "2 ranks under mpirun ready in {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let (launcher, ranks) = launcher_and_ranks(&exec);
    // Ranks are mpirun's children, not ours; each leads its own process group.
    let children = child_pids();
    assert_eq!(children, [launcher], "our only child is mpirun");

    let t = Instant::now();
    let out = exec
        .run_task(
            "train",
            Shareable::new().with_meta("round", 0),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    let took = t.elapsed();
    let acc = meta_f64(&out, "test_accuracy");
    eprintln!(
        "task `train` (10 epochs, 2 ranks all-reducing gradients): {:.0} ms, test accuracy {acc:.4}, train loss {:.4}",
        took.as_secs_f64() * 1e3,
        meta_f64(&out, "train_loss"),
    );
    assert!(
        acc >= STATED_ACCURACY,
        "test accuracy {acc} < {STATED_ACCURACY}"
    );
    assert_eq!(meta_i64(&out, "mpi_world_size"), 2);
    assert_eq!(meta_i64(&out, "num_samples"), 1438, "every rank's share");
    assert_eq!(meta_i64(&out, "steps"), 10 * 45);
    assert_eq!(out.blob("weights").map(|b| b.len()), Some(640 * 4));
    assert_eq!(out.blob("bias").map(|b| b.len()), Some(10 * 4));

    // The group lives on across tasks (MPI is initialized once per rank process); a
    // second round starts from the first one's model.
    let input = ["weights", "bias"]
        .into_iter()
        .fold(Shareable::new().with_meta("round", 1), |s, k| {
            s.with_blob(k, out.blob(k).unwrap().clone())
        });
    let out2 = exec
        .run_task("train", input, &mut ctx, &Signal::new())
        .unwrap();
    assert!(meta_f64(&out2, "test_accuracy") >= STATED_ACCURACY);
    assert!(meta_f64(&out2, "train_loss") < meta_f64(&out, "train_loss"));
    assert_eq!(
        launcher_and_ranks(&exec),
        (launcher, ranks.clone()),
        "same processes"
    );

    let t = Instant::now();
    let report = exec.finalize().unwrap();
    eprintln!(
        "mpirun group finalized in {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(report.unkillable.is_empty(), "{report:?}");
    let mut all = ranks.clone();
    all.push(launcher);
    assert_gone(&all, "mpirun and its ranks after finalize");
    assert!(child_pids().is_empty(), "no child left: {:?}", child_pids());
    // Every rank finalized MPI, so mpirun saw a normal end.
    let launcher_log =
        std::fs::read_to_string(logs.path().join("launcher/stderr.log")).unwrap_or_default();
    assert!(
        !launcher_log.contains("exiting improperly"),
        "mpirun complained: {launcher_log}"
    );
}

#[test]
fn rank_killed_under_mpirun_is_detected() {
    let _serial = serial();
    host_log();
    let logs = tempfile::tempdir().unwrap();
    // Long enough that the kill lands mid-task.
    let exec = MultiProcessExecutor::new(mpi_config(
        logs.path(),
        Some(serde_json::json!({"epochs": 100_000})),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    let (launcher, ranks) = launcher_and_ranks(&exec);
    let victim = ranks[1];
    // The kill lands mid-task: once the task was sent (100 000 epochs take minutes).
    let sent = host_log().text().matches("task sent").count();
    let killer = once_task_sent(sent, move || {
        kill(Pid::from_raw(victim as i32), Sig::SIGKILL).unwrap();
        Instant::now()
    });
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let returned = Instant::now();
    let killed_at = killer.join().unwrap();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{}", chain(&err))
    };
    assert_eq!(failure.rank, 1, "{}", chain(&err));
    assert_eq!(failure.pid, Some(victim));
    eprintln!(
        "rank 1 SIGKILLed under mpirun: run_task returned {:.1} ms later: {}",
        (returned - killed_at).as_secs_f64() * 1e3,
        chain(&err)
    );
    let mut all = ranks.clone();
    all.push(launcher);
    assert_gone(&all, "mpirun and its ranks after the failure");
    exec.finalize().unwrap();
    assert!(child_pids().is_empty(), "no child left: {:?}", child_pids());
}

#[test]
fn abort_stops_every_rank_at_the_same_step() {
    let _serial = serial();
    host_log();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(mpi_config(
        logs.path(),
        Some(serde_json::json!({"epochs": 100_000})),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    let before = launcher_and_ranks(&exec);
    // The abort lands mid-task: once the task was sent.
    let abort = Signal::new();
    let sent = host_log().text().matches("task sent").count();
    let trigger = abort.clone();
    let aborter = once_task_sent(sent, move || {
        trigger.trigger("stop");
        Instant::now()
    });
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &abort)
        .unwrap_err();
    let took = aborter.join().unwrap().elapsed();
    let ExecuteError::Aborted { forced, .. } = &err else {
        panic!("{}", chain(&err))
    };
    assert!(!forced, "every rank returned in time: {}", chain(&err));
    eprintln!(
        "abort: every rank returned {:.1} ms after the signal",
        took.as_secs_f64() * 1e3
    );
    // No rank was left in a collective: the same group runs the next task.
    assert_eq!(launcher_and_ranks(&exec), before);
    let out = exec
        .run_task(
            "train",
            Shareable::new().with_meta("epochs", 1),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(meta_i64(&out, "steps"), 45);
    assert_eq!(launcher_and_ranks(&exec), before);
    drop(exec);
    let (launcher, mut all) = before;
    all.push(launcher);
    assert_gone(&all, "mpirun and its ranks after drop");
    assert!(child_pids().is_empty(), "no child left: {:?}", child_pids());
}

/// docs/gpus-launchers.md's MPI command, read from the page and run as shown, with this
/// build's `rankexec` (built with the `mpi` feature, as the page's `cargo build` makes
/// it) for `target/release/rankexec` and first on PATH (the config's worker program);
/// as root, with the two variables Open MPI then needs (the page says so). What it
/// prints is compared with the page's lines.
#[test]
fn the_guides_mpi_command_runs_as_shown() {
    let _serial = serial();
    let steps = console("docs/gpus-launchers.md", "mpi");
    assert_eq!(steps.len(), 1, "one command");
    assert!(
        steps.iter().all(|s| !s.cmd.contains('\n')),
        "one line per command"
    );
    let tmp = tempfile::tempdir().unwrap();
    for step in &steps {
        let argv: Vec<&str> = step.cmd.split_whitespace().collect();
        assert!(
            !step.cmd.contains(['\'', '"', '|', '&', ';', '>', '<']),
            "{}",
            step.cmd
        );
        assert_eq!(argv[0], "target/release/rankexec", "{}", step.cmd);
        let bin = rankexec_bin();
        let path = format!(
            "{}:{}",
            bin.parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out_path = tmp.path().join("out");
        let out = std::fs::File::create(&out_path).unwrap();
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(&argv[1..])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("PATH", path)
            .env("TMPDIR", tmp.path())
            .env_remove("RANKEXEC_LOG")
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if nix::unistd::geteuid().is_root() {
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        let status = wait_exit(&mut cmd.spawn().unwrap(), Duration::from_secs(120));
        let text = std::fs::read_to_string(&out_path).unwrap();
        let shown: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(status.code(), Some(step.code), "`{}`:\n{text}", step.cmd);
        assert!(
            output_matches(&step.lines, &shown),
            "`{}` did not print what the page shows:\n{}\nit printed:\n{text}",
            step.cmd,
            step.lines.join("\n")
        );
    }
}
