//! The real `srun` as the launcher, under a real (single-machine) Slurm cluster that
//! `scripts/slurm-test.sh` starts from Debian's packages and names in
//! `RANKEXEC_TEST_SLURM_CONF`. Ranks take their rank from `SLURM_PROCID`; a task fans
//! out and comes back; an abort reaches the rank code; a rank killed by a signal is
//! reported with its rank; END_RUN and a SIGKILL of the host leave no job step, no
//! `slurmstepd` and no rank (asked of `squeue` and the process table).
//!
//! Without `RANKEXEC_TEST_SLURM_CONF` each test prints why it is skipped and returns.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::group::process::Role;
use rankexec::executor::{Dur, ExecuteError, ExecutorConfig, LauncherConfig, MultiProcessExecutor};
use rankexec::protocol::{EventType, FlComponent, Shareable, Signal, Value};

/// The cluster's slurm.conf, or why there is none.
fn slurm_conf() -> Result<PathBuf, String> {
    let conf = std::env::var_os("RANKEXEC_TEST_SLURM_CONF").ok_or(
        "no Slurm cluster: RANKEXEC_TEST_SLURM_CONF is unset (scripts/slurm-test.sh starts one)",
    )?;
    let conf = PathBuf::from(conf);
    if !conf.is_file() {
        return Err(format!(
            "RANKEXEC_TEST_SLURM_CONF={} is not a file",
            conf.display()
        ));
    }
    Ok(conf)
}

macro_rules! slurm_or_skip {
    () => {
        match slurm_conf() {
            Ok(c) => c,
            Err(why) => {
                eprintln!("SKIPPED: {why}");
                return;
            }
        }
    };
}

fn srun_config(conf: &Path, logs: &Path, path: &str) -> ExecutorConfig {
    let mut c = config(2, path, serde_json::json!({}), logs);
    c.launcher = LauncherConfig::Srun {
        // One node here; `--overlap` lets a step share CPUs a previous test's step
        // may still hold while Slurm cleans it up.
        extra_args: vec!["--overlap".into()],
    };
    c.env
        .set
        .insert("SLURM_CONF".into(), conf.display().to_string());
    let d = &mut c.deadlines;
    // srun asks slurmctld for an allocation first.
    d.startup = Dur(Duration::from_secs(60));
    d.heartbeat_timeout = Dur(Duration::from_secs(10));
    d.shutdown_grace = Dur(Duration::from_secs(5));
    c.restart.max_restarts = 0;
    c
}

/// Runs a Slurm client command with the test cluster's configuration.
fn slurm(conf: &Path, prog: &str, args: &[&str]) -> String {
    let out = Command::new(prog)
        .args(args)
        .env("SLURM_CONF", conf)
        .output()
        .unwrap_or_else(|e| panic!("{prog}: {e}"));
    assert!(
        out.status.success(),
        "{prog} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Job steps Slurm knows of (`squeue --steps`), one `JOBID.STEPID` per line.
fn steps(conf: &Path) -> Vec<String> {
    slurm(conf, "squeue", &["--steps", "--noheader", "--format=%i"])
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// Pids of processes named `name` (their `comm`).
fn processes_named(name: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name)
            && pid_alive(pid)
        {
            out.push(pid);
        }
    }
    out
}

/// Waits until Slurm shows no step and no `slurmstepd` runs; panics naming what is left.
fn assert_no_step_left(conf: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (s, d) = (steps(conf), processes_named("slurmstepd"));
        if s.is_empty() && d.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: steps {s:?} and slurmstepd {d:?} still there after 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asserts every pid is gone within 30 s: srun leaves once slurmd reports the step's
/// end (its `KillWait` is 5 s here), slower on a busy machine than a local teardown.
#[track_caller]
fn assert_gone_under_slurm(pids: &[u32], what: &str) {
    let within = Duration::from_secs(30);
    if let Err(alive) = wait_gone(pids, within) {
        panic!("{what}: pids {alive:?} still alive after {within:?}");
    }
}

/// srun's pid and the ranks' pids, by rank.
fn launcher_and_ranks(exec: &MultiProcessExecutor) -> (u32, Vec<u32>) {
    let procs = exec.status().processes;
    let launcher: Vec<u32> = procs
        .iter()
        .filter(|p| p.role == Role::Launcher)
        .map(|p| p.pid)
        .collect();
    assert_eq!(launcher.len(), 1, "one srun: {procs:?}");
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
        "two ranks: {procs:?}"
    );
    (launcher[0], ranks.into_iter().map(|(_, p)| p).collect())
}

/// The host's log, installed once for the whole binary.
fn host_log() -> &'static LogCapture {
    static LOG: std::sync::OnceLock<LogCapture> = std::sync::OnceLock::new();
    LOG.get_or_init(LogCapture::install)
}

/// One variable of a live process's environment.
fn environ_var(pid: u32, key: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix(&format!("{key}=")).map(str::to_owned)
    })
}

#[test]
fn srun_ranks_take_their_rank_from_slurm_and_end_run_leaves_nothing() {
    let conf = slurm_or_skip!();
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(srun_config(&conf, logs.path(), "Echo")).unwrap();
    let mut ctx = start(&exec);
    let (srun, ranks) = launcher_and_ranks(&exec);
    for (rank, pid) in ranks.iter().enumerate() {
        // The kernel's pid for the connection that said "rank N" is the process Slurm
        // gave SLURM_PROCID=N (one node: the local id too).
        assert_eq!(
            environ_var(*pid, "SLURM_PROCID").as_deref(),
            Some(rank.to_string().as_str())
        );
        assert_eq!(
            environ_var(*pid, "SLURM_LOCALID").as_deref(),
            Some(rank.to_string().as_str())
        );
        assert_eq!(environ_var(*pid, "RANKEXEC_RANK"), None, "no rank from us");
        assert_eq!(
            environ_var(*pid, "RANKEXEC_RANK_SOURCE").as_deref(),
            Some("slurm")
        );
    }
    let live = steps(&conf);
    assert_eq!(live.len(), 1, "one job step runs the ranks: {live:?}");
    for round in 0..3 {
        let out = exec
            .run_task(
                "echo",
                Shareable::new().with_meta("round", round),
                &mut ctx,
                &Signal::new(),
            )
            .unwrap();
        assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
        assert_eq!(out.meta("round"), Some(&Value::Int(round)));
    }
    exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
    let mut all = ranks.clone();
    all.push(srun);
    assert_gone_under_slurm(&all, "srun and its ranks after END_RUN");
    assert_no_step_left(&conf, "END_RUN");
    eprintln!(
        "srun: step {live:?}, ranks {ranks:?} (SLURM_PROCID 0 and 1), 3 tasks; END_RUN: no step, no slurmstepd, no rank"
    );
}

#[test]
fn srun_ranks_number_gpus_as_torchrun() {
    // A declared inventory of 3 GPUs (no GPU needed): best fit places rank 0 on GPU 1
    // and rank 1 on GPU 2; each rank sees both, its own at index SLURM_LOCALID.
    use rankexec::executor::admission::Admission;
    use rankexec::executor::admission::host::SysinfoHost;
    use rankexec::executor::admission::ledger::Ledger;
    use rankexec::executor::gpu::{FixedInventory, GpuInfo, Inventory};
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    let conf = slurm_or_skip!();
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    const GIB: u64 = 1 << 30;
    let gpus = [70u64, 24, 38]
        .iter()
        .enumerate()
        .map(|(i, free)| GpuInfo {
            index: i as u32,
            uuid: format!("GPU-slurm-{i}"),
            name: "declared GPU".into(),
            memory_total: 80 * GIB,
            memory_free: free * GIB,
            memory_used: (80 - free) * GIB,
            utilization_gpu: None,
            utilization_memory: None,
            processes: vec![],
        })
        .collect();
    let mut cfg = srun_config(&conf, logs.path(), "Echo");
    cfg.resources.gpu_memory = Some(rankexec::executor::ByteSize(GIB));
    let cfg = Arc::new(cfg);
    let ledger = logs.path().join("ledger");
    std::fs::create_dir_all(&ledger).unwrap();
    std::fs::set_permissions(&ledger, std::fs::Permissions::from_mode(0o700)).unwrap();
    let admission = Admission::with_probes(
        cfg.clone(),
        Arc::new(FixedInventory(Inventory::Gpus { driver: None, gpus })),
        Arc::new(SysinfoHost::new()),
        Ledger::at(ledger.join("ledger.json")),
    );
    let exec = MultiProcessExecutor::with_admission(cfg, admission).unwrap();
    let mut ctx = start(&exec);
    let (srun, ranks) = launcher_and_ranks(&exec);
    let placed = ["GPU-slurm-1", "GPU-slurm-2"];
    for (rank, pid) in ranks.iter().enumerate() {
        let visible = environ_var(*pid, "CUDA_VISIBLE_DEVICES").unwrap_or_default();
        let local: usize = environ_var(*pid, "SLURM_LOCALID").unwrap().parse().unwrap();
        let list: Vec<&str> = visible.split(',').collect();
        assert_eq!(
            list, placed,
            "rank {rank} sees the group's GPUs in rank order"
        );
        assert_eq!(
            list[local], placed[rank],
            "rank {rank}: device SLURM_LOCALID"
        );
        assert_eq!(
            environ_var(*pid, "CUDA_DEVICE_ORDER").as_deref(),
            Some("PCI_BUS_ID")
        );
    }
    exec.run_task("echo", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
    let mut all = ranks.clone();
    all.push(srun);
    assert_gone_under_slurm(&all, "srun and its ranks after END_RUN");
    assert_no_step_left(&conf, "END_RUN");
}

#[test]
fn abort_reaches_ranks_under_srun() {
    let conf = slurm_or_skip!();
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(srun_config(&conf, logs.path(), "Sleep")).unwrap();
    let mut ctx = start(&exec);
    let before = launcher_and_ranks(&exec);
    let (abort, fired) = abort_after(Duration::from_millis(500), "test abort");
    let err = exec
        .run_task(
            "t",
            Shareable::new().with_meta("secs", 120.0),
            &mut ctx,
            &abort,
        )
        .unwrap_err();
    let _ = fired.join();
    let ExecuteError::Aborted { forced, .. } = &err else {
        panic!("{}", chain(&err))
    };
    assert!(!forced, "the ranks returned on the abort: {}", chain(&err));
    // The rank code saw it and returned; the same step runs the next task.
    assert_eq!(launcher_and_ranks(&exec), before);
    exec.run_task(
        "t",
        Shareable::new().with_meta("secs", 0.01),
        &mut ctx,
        &Signal::new(),
    )
    .unwrap();
    eprintln!("abort under srun: {}", chain(&err));
    let (srun, mut all) = before;
    all.push(srun);
    exec.finalize().unwrap();
    assert_gone_under_slurm(&all, "srun and its ranks after finalize");
    assert_no_step_left(&conf, "finalize");
}

#[test]
fn a_rank_killed_under_srun_is_reported_with_its_rank() {
    let conf = slurm_or_skip!();
    let _serial = serial();
    host_log();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(srun_config(&conf, logs.path(), "Sleep")).unwrap();
    let mut ctx = start(&exec);
    let (srun, ranks) = launcher_and_ranks(&exec);
    let victim = ranks[1];
    // Mid-task: once the dispatcher has sent the task.
    let sent = host_log().text().matches("task sent").count();
    let killer = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while host_log().text().matches("task sent").count() <= sent {
            assert!(Instant::now() < deadline, "the task was never sent");
            std::thread::sleep(Duration::from_millis(10));
        }
        kill(Pid::from_raw(victim as i32), Sig::SIGKILL).unwrap();
    });
    let err = exec
        .run_task(
            "t",
            Shareable::new().with_meta("secs", 120.0),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap_err();
    killer.join().unwrap();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{}", chain(&err))
    };
    assert_eq!(failure.rank, 1, "{}", chain(&err));
    assert_eq!(failure.pid, Some(victim));
    eprintln!("rank 1 SIGKILLed under srun: {}", chain(&err));
    let mut all = ranks.clone();
    all.push(srun);
    assert_gone_under_slurm(&all, "srun and its ranks after the failure");
    assert_no_step_left(&conf, "a killed rank");
    exec.finalize().unwrap();
}

/// A `rankexec run` host of `cfg` (its task sleeps 120 s) and the pids it printed once
/// its group was ready (srun's and its ranks'), each killed when dropped (a failing
/// check leaves none of them).
fn spawn_host(cfg: &ExecutorConfig, dir: &Path) -> ((Reaper, Held), Vec<u32>) {
    let mut cfg = cfg.clone();
    cfg.components[0].args = serde_json::json!({"secs": 120});
    let cfg_path = dir.join("cfg.json");
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let mut host = Reaper(
        Command::new(rankexec_bin())
            .args(["run", "--task", "t", "--print-pids", "--config"])
            .arg(&cfg_path)
            .env("RANKEXEC_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(host.0.stdout.take().unwrap()).lines();
    let pids_line = loop {
        let line = lines.next().expect("the host printed its pids").unwrap();
        if let Some(rest) = line.strip_prefix("pids: ") {
            break rest.to_owned();
        }
    };
    let pids: Vec<u32> = pids_line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse().ok())
        .collect();
    assert!(!pids.is_empty(), "pids: {pids_line}");
    // The host is alive and holds its group: these pids are srun and its ranks.
    let held = Held::new(&pids);
    ((host, held), pids)
}

#[test]
fn a_sigkilled_host_leaves_no_step_under_srun() {
    let conf = slurm_or_skip!();
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let cfg = srun_config(&conf, logs.path(), "Sleep");
    let ((mut host, _held), pids) = spawn_host(&cfg, logs.path());
    assert_eq!(steps(&conf).len(), 1, "one step runs");
    kill(Pid::from_raw(host.0.id() as i32), Sig::SIGKILL).unwrap();
    let _ = host.0.wait();
    assert_gone_under_slurm(&pids, "ranks and srun after the host's SIGKILL");
    assert_no_step_left(&conf, "SIGKILL of the host");
    eprintln!("host SIGKILLed under srun: {pids:?} gone; no step, no slurmstepd");
}

/// The host is SIGKILLed while every core is busy (busy processes this test starts
/// and reaps): the ranks leave by their connections' end of file, without waiting for
/// Slurm to end their step, and srun leaves on the kernel's `SIGTERM` (it cancels its
/// step). The figures are printed, not asserted (BENCHMARKS.md).
#[test]
fn ranks_leave_a_sigkilled_host_on_a_busy_machine_under_srun() {
    let conf = slurm_or_skip!();
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let cfg = srun_config(&conf, logs.path(), "Sleep");
    let ((mut host, _held), pids) = spawn_host(&cfg, logs.path());
    let worker = std::fs::canonicalize(worker_bin()).unwrap();
    let (ranks, srun): (Vec<u32>, Vec<u32>) = pids
        .iter()
        .copied()
        .partition(|p| std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|exe| exe == worker));
    assert_eq!(ranks.len(), 2, "two ranks among {pids:?}");
    let hogs = Hogs::start();
    let t = Instant::now();
    kill(Pid::from_raw(host.0.id() as i32), Sig::SIGKILL).unwrap();
    let _ = host.0.wait();
    if let Err(alive) = wait_gone(&ranks, Duration::from_secs(10)) {
        for p in &alive {
            let _ = kill(Pid::from_raw(*p as i32), Sig::SIGKILL);
        }
        panic!("ranks {alive:?} outlived their SIGKILLed host by 10 s under srun");
    }
    let ranks_took = t.elapsed();
    assert_gone_under_slurm(&srun, "srun after the host's SIGKILL");
    let srun_took = t.elapsed();
    let busy = hogs.count();
    drop(hogs);
    assert_no_step_left(&conf, "SIGKILL of the host on a busy machine");
    eprintln!(
        "srun, host SIGKILLed with {busy} busy processes: ranks {ranks:?} gone in {:.1} ms, \
         srun {srun:?} in {:.1} ms; no step left",
        ranks_took.as_secs_f64() * 1e3,
        srun_took.as_secs_f64() * 1e3
    );
}
