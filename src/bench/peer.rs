//! `rankexec bench --peer nvflare`: the NVFlare peer harness's experiments, run on
//! rankexec and printed as the harness's own JSON records (`impl: "rankexec"`), so that
//! `summarize.py nvflare.jsonl rankexec.jsonl` puts both side by side.
//!
//! The harness (`shared/peers/nvflare/`) drives NVFlare's `MultiProcessExecutor` inside
//! `nvflare simulator`; here the same work drives [`MultiProcessExecutor`] directly,
//! through the same entry points a client runtime uses (`handle_event(START_RUN)`,
//! `execute`, `handle_event(END_RUN)`), with the built-in components standing in for the
//! harness's `EchoExecutor`:
//!
//! | harness | here |
//! |---|---|
//! | startup N = 1, 2, 4, 3 runs each | same; `ranks_spawned_s` and `all_ranks_reachable_s` are not observable from outside the executor and are null |
//! | round trip N = 2, 1 KB to 64 MB, echo / sum, 5 rounds after 1 warm-up | `Echo` / `Digest` (every rank checksums, rank 0 answers); `execute()` returns when rank 0's result arrives, so arrival is reported as the `execute()` time (an upper bound) |
//! | END_RUN → finalize, abort in flight, abort already triggered | same |
//! | faults a (SIGKILL rank idle), b (rank raises), c (parent SIGKILLed), d (two executors at once) | same; c runs `rankexec run` as the parent |
//!
//! No fault here has a cap to wait out: each returns a typed error at once.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::os::fd::{AsFd as _, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rankexec_executor::{ExecuteError, MultiProcessExecutor};
use rankexec_protocol::{
    Blob, EventType, Executor as _, FlComponent as _, FlContext, Shareable, Signal, Value,
};
use rankexec_sub_worker::builtins::checksum;
use serde_json::{Value as Json, json};

use super::cases::{Setup, payload};

/// Runs every experiment and prints one record per line. `quick`: one start-up per N
/// and payloads up to 1 MB (a smoke run).
pub fn run(s: &Setup<'_>, quick: bool) -> anyhow::Result<()> {
    env();
    startup(s, if quick { 1 } else { 3 })?;
    roundtrip(s, if quick { 2 } else { 4 })?;
    abort(s)?;
    fault_a(s)?;
    fault_b(s)?;
    fault_c(s)?;
    fault_d(s)?;
    Ok(())
}

fn emit(metric: &str, mut fields: Json) {
    if let Some(m) = fields.as_object_mut() {
        m.insert("impl".into(), "rankexec".into());
        m.insert("metric".into(), metric.into());
    }
    println!("{fields}");
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn env() {
    let total = sysinfo::System::new().ok().map(|mut sys| {
        sys.refresh_memory();
        sys.total_memory()
    });
    emit(
        "env",
        json!({
            "rankexec_version": env!("CARGO_PKG_VERSION"),
            "cpu_count": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "mem_total_gib": total.map(|t| (t as f64 / f64::from(1u32 << 30) * 10.0).round() / 10.0),
            "platform": std::env::consts::OS,
        }),
    );
}

/// The host's side of START_RUN: a context and the event.
fn start_run(exec: &MultiProcessExecutor) -> anyhow::Result<(FlContext, Duration)> {
    let mut ctx = FlContext::new();
    let t = Instant::now();
    exec.handle_event(&EventType::START_RUN, &mut ctx)
        .context("START_RUN")?;
    Ok((ctx, t.elapsed()))
}

/// END_RUN as the host sends it, then when each rank was gone (by pidfd).
fn end_run(exec: &MultiProcessExecutor, ctx: &mut FlContext, n: u32, run: &str) {
    let pids = exec.live_pids();
    let watch = Exits::open(&pids);
    let t = Instant::now();
    let r = exec.handle_event(&EventType::END_RUN, ctx);
    let call = t.elapsed();
    let gone = watch.wait(t, Duration::from_secs(30));
    emit(
        "abort",
        json!({
            "case": "END_RUN->finalize (ranks idle)", "run": run, "n": n,
            "finalize_call_s": secs(call),
            "all_gone_s": gone.values().copied().collect::<Option<Vec<f64>>>()
                .map(|v| v.into_iter().fold(0.0, f64::max)),
            "per_process_gone_s": gone,
            "errors": r.err().map(|e| e.to_string()),
        }),
    );
}

fn startup(s: &Setup<'_>, runs: usize) -> anyhow::Result<()> {
    for n in [1, 2, 4] {
        for r in 0..runs {
            let run = format!("startup_n{n}_r{r}");
            let exec = MultiProcessExecutor::new(s.config(n, "Echo", json!({})))?;
            let started = start_run(&exec);
            let (ready, took, errors) = match &started {
                Ok((_, d)) => (true, Some(secs(*d)), Vec::new()),
                Err(e) => (false, None, vec![format!("{e:#}")]),
            };
            emit(
                "startup",
                json!({
                    "run": run, "n": n, "ready": ready, "start_run_to_ready_s": took,
                    "ranks_spawned_s": null, "all_ranks_reachable_s": null, "errors": errors,
                }),
            );
            if let Ok((mut ctx, _)) = started {
                end_run(&exec, &mut ctx, n, &run);
            }
        }
    }
    Ok(())
}

/// `sizes`: how many of 1 KB, 1 MB, 16 MB, 64 MB.
fn roundtrip(s: &Setup<'_>, sizes: usize) -> anyhow::Result<()> {
    const ROUNDS: usize = 5;
    for (mode, path, args) in [("echo", "Echo", json!({})), ("sum", "Digest", json!({}))] {
        let exec = MultiProcessExecutor::new(s.config(2, path, args))?;
        let (mut ctx, _) = start_run(&exec)?;
        for size in [1usize << 10, 1 << 20, 16 << 20, 64 << 20]
            .into_iter()
            .take(sizes)
        {
            let data = payload(size);
            let want = checksum(&data);
            let blob = Blob::from(bytes::Bytes::from(data));
            let mut times = Vec::new();
            let mut ok = true;
            let mut statuses = Vec::new();
            for round in 0..=ROUNDS {
                let input = Shareable::new().with_blob("m", blob.clone());
                let t = Instant::now();
                let out = exec.execute("nvfbench", input, &mut ctx, &Signal::new());
                let dt = t.elapsed();
                let good = match (&out, mode) {
                    (Ok(o), "echo") => o.blob("m").map(|b| checksum(b)) == Some(want),
                    (Ok(o), _) => o.meta("digest:m").and_then(Value::as_i64) == Some(want as i64),
                    (Err(_), _) => false,
                };
                statuses.push(match &out {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => e.to_string(),
                });
                ok &= good;
                if round > 0 {
                    times.push(secs(dt));
                }
            }
            let (median, min, max) = super::report::stats(&mut times);
            let mbps = size as f64 / 1e6 / median;
            emit(
                "roundtrip",
                json!({
                    "run": "roundtrip", "n": 2, "size_bytes": size, "mode": mode,
                    "rounds": ROUNDS, "ok": ok, "statuses": statuses,
                    "median_s": median, "min_s": min, "max_s": max,
                    "median_result_arrival_s": median,
                    "payload_MBps": mbps, "payload_MBps_at_arrival": mbps,
                }),
            );
        }
        exec.handle_event(&EventType::END_RUN, &mut ctx)?;
    }
    Ok(())
}

fn abort(s: &Setup<'_>) -> anyhow::Result<()> {
    // Abort 0.5 s into a 5 s task.
    let exec = Arc::new(MultiProcessExecutor::new(s.config(
        2,
        "Sleep",
        json!({"secs": 5}),
    ))?);
    let (ctx, _) = start_run(&exec)?;
    let signal = Signal::new();
    let (e, sig) = (exec.clone(), signal.clone());
    let t = Instant::now();
    let task = std::thread::spawn(move || {
        let mut ctx = ctx;
        let r = e.run_task("nvfbench", Shareable::new(), &mut ctx, &sig);
        (r, Instant::now(), ctx)
    });
    std::thread::sleep(Duration::from_millis(500));
    let aborted_at = t.elapsed();
    signal.trigger("bench: abort in flight");
    let (r, returned, mut ctx) = task
        .join()
        .map_err(|_| anyhow::anyhow!("task thread panicked"))?;
    let alive = exec.live_pids();
    emit(
        "abort",
        json!({
            "case": "abort_signal triggered during an in-flight task", "n": 2,
            "abort_triggered_at_s": secs(aborted_at), "rank_task_duration_s": 5.0,
            "execute_status": status(&r),
            "execute_returned_at_s": secs(returned - t),
            "execute_returned_after_abort_s": secs(returned - t) - secs(aborted_at),
            "ranks_alive_after": {"0": alive.len() == 2, "1": alive.len() == 2},
        }),
    );
    // Execute with the signal already triggered: refused at once, the group stays.
    let signal = Signal::new();
    signal.trigger("bench: already aborted");
    let t = Instant::now();
    let r = exec.run_task("nvfbench", Shareable::new(), &mut ctx, &signal);
    let took = t.elapsed();
    emit(
        "abort",
        json!({
            "case": "execute() called with abort_signal already triggered", "n": 2,
            "execute_status": status(&r), "execute_returned_s": secs(took),
            "all_gone_s": null, "ranks_alive_after": exec.live_pids().len(),
        }),
    );
    exec.handle_event(&EventType::END_RUN, &mut ctx)?;
    Ok(())
}

fn status(r: &Result<Shareable, ExecuteError>) -> String {
    match r {
        Ok(_) => "ok".to_owned(),
        Err(e) => format!("{:?}: {}", e.class(), rankexec_protocol::error_chain(e)),
    }
}

fn fault_a(s: &Setup<'_>) -> anyhow::Result<()> {
    for victim in [1usize, 0] {
        let exec = MultiProcessExecutor::new(s.config(2, "Echo", json!({})))?;
        let (mut ctx, _) = start_run(&exec)?;
        let pids = exec.live_pids();
        let pid = *pids.get(victim).context("rank pid")?;
        let watch = Exits::open(&[pid]);
        let t = Instant::now();
        kill(pid)?;
        let gone = watch.wait(t, Duration::from_secs(10));
        let t = Instant::now();
        let r = exec.run_task("nvfbench", Shareable::new(), &mut ctx, &Signal::new());
        let took = t.elapsed();
        let next = exec.run_task("nvfbench", Shareable::new(), &mut ctx, &Signal::new());
        emit(
            "fault",
            json!({
                "case": format!("a_kill_rank{victim}_idle_then_execute"), "run": "fault_a_n2",
                "n": 2, "killed_rank": victim, "victim_gone_s": gone.values().next().copied().flatten(),
                "execute_status": status(&r), "execute_elapsed_s": secs(took),
                "result_from_rank": r.as_ref().ok().and_then(|o| o.meta("rank").and_then(Value::as_i64)),
                "errors_logged": r.as_ref().err().map(|e| vec![rankexec_protocol::error_chain(e)]).unwrap_or_default(),
                "victim_cell_still_reachable": false,
                "next_execute_status": status(&next),
            }),
        );
        exec.handle_event(&EventType::END_RUN, &mut ctx)?;
    }
    Ok(())
}

fn fault_b(s: &Setup<'_>) -> anyhow::Result<()> {
    for rank in [1u32, 0] {
        let args = json!({"ranks": [rank], "tasks": ["raise"], "message": "RuntimeError"});
        let exec = MultiProcessExecutor::new(s.config(2, "Fail", args))?;
        let (mut ctx, _) = start_run(&exec)?;
        let t = Instant::now();
        let r = exec.run_task("raise", Shareable::new(), &mut ctx, &Signal::new());
        let took = t.elapsed();
        let alive = exec.live_pids().len() == 2;
        let t = Instant::now();
        let next = exec.run_task("normal", Shareable::new(), &mut ctx, &Signal::new());
        let next_took = t.elapsed();
        emit(
            "fault",
            json!({
                "case": format!("b_rank{rank}_raises_in_execute"), "run": "fault_b_n2", "n": 2,
                "execute_status": status(&r), "execute_elapsed_s": secs(took),
                "result_rc": r.as_ref().err().map(|e| format!("{:?}", e.class())),
                "errors_logged_in_parent": r.as_ref().err().map(|e| vec![rankexec_protocol::error_chain(e)]).unwrap_or_default(),
                "ranks_alive_after": {"0": alive, "1": alive},
                "next_normal_execute_status": status(&next),
                "next_normal_execute_s": secs(next_took),
            }),
        );
        exec.handle_event(&EventType::END_RUN, &mut ctx)?;
    }
    Ok(())
}

/// The parent (a `rankexec run` process with a 2-rank group in a task) is SIGKILLed.
fn fault_c(s: &Setup<'_>) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let config = json!({
        "executor_id": "sleep", "num_of_processes": 2,
        "components": [{"id": "sleep", "path": "Sleep", "args": {"secs": 600}}],
        "worker": {"program": s.program, "args": s.args},
        "gpu": {"mode": "none"}, "log_dir": s.logs,
    });
    let path = s.logs.join("fault_c.json");
    std::fs::write(&path, config.to_string())?;
    let mut child = Command::new(&exe)
        .arg("run")
        .arg("--config")
        .arg(&path)
        .arg("--print-pids")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start `rankexec run`")?;
    let stdout = child.stdout.take().context("no stdout")?;
    // `run` prints the ranks' pids once every rank is up; the task then sleeps.
    let ranks: Vec<u32> = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix("pids: ").map(|p| {
                p.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default();
    let ready = ranks.len() == 2;
    let watch = Exits::open(&ranks);
    let t = Instant::now();
    kill(child.id())?;
    let _ = child.wait();
    let gone = watch.wait(t, Duration::from_secs(60));
    let survivors: Vec<&String> = gone
        .iter()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| k)
        .collect();
    let last = gone.values().copied().collect::<Option<Vec<f64>>>();
    emit(
        "fault",
        json!({
            "case": "c_parent_sigkill", "n": 2, "group_was_ready": ready,
            "outcome": match &last {
                Some(v) if !v.is_empty() => format!(
                    "ranks exited on their own {:.4}s after the parent was SIGKILLed",
                    v.iter().copied().fold(0.0, f64::max)
                ),
                _ if !ready => "the host never reported its ranks' pids".to_owned(),
                _ => format!("ranks still alive after 60 s: {survivors:?}"),
            },
            "per_process_gone_after_parent_kill_s": gone,
            "orphans_after_cap": survivors,
            "simulator_exited_by_itself": null,
        }),
    );
    Ok(())
}

/// Two executors started at the same instant, each doing 1 KB and 1 MB round trips.
fn fault_d(s: &Setup<'_>) -> anyhow::Result<()> {
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let mut threads = Vec::new();
    for _ in 0..2 {
        let cfg = s.config(2, "Env", json!({}));
        let b = barrier.clone();
        threads.push(std::thread::spawn(
            move || -> anyhow::Result<(String, f64, bool)> {
                let exec = MultiProcessExecutor::new(cfg)?;
                b.wait();
                let (mut ctx, took) = start_run(&exec)?;
                let mut ok = true;
                let mut endpoint = String::new();
                for size in [1usize << 10, 1 << 20] {
                    let input = Shareable::new().with_blob("m", payload(size));
                    let out = exec.execute("nvfbench", input, &mut ctx, &Signal::new());
                    match out {
                        Ok(o) => {
                            endpoint = o
                                .meta("env:RANKEXEC_ENDPOINT")
                                .and_then(Value::as_str)
                                .unwrap_or("?")
                                .to_owned();
                        }
                        Err(_) => ok = false,
                    }
                }
                exec.handle_event(&EventType::END_RUN, &mut ctx)?;
                Ok((endpoint, secs(took), ok))
            },
        ));
    }
    let mut results = Vec::new();
    for t in threads {
        match t.join() {
            Ok(r) => results.push(r),
            Err(_) => anyhow::bail!("executor thread panicked"),
        }
    }
    let started: Vec<&(String, f64, bool)> =
        results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let urls: Vec<&str> = started.iter().map(|r| r.0.as_str()).collect();
    emit(
        "fault",
        json!({
            "case": "d_two_executors_at_once", "n": 2,
            "internal_listener_urls": urls, "root_urls": [],
            "listener_port_collision": urls.len() == 2 && urls[0] == urls[1],
            "both_started": started.len() == 2,
            "start_run_to_ready_s": started.iter().map(|r| r.1).collect::<Vec<_>>(),
            "all_roundtrips_ok": started.len() == 2 && started.iter().all(|r| r.2),
            "errors": results.iter().filter_map(|r| r.as_ref().err().map(|e| format!("{e:#}"))).collect::<Vec<_>>(),
        }),
    );
    Ok(())
}

fn kill(pid: u32) -> anyhow::Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .with_context(|| format!("cannot SIGKILL {pid}"))
}

/// Processes watched through pidfds (opened before they are signalled, so a reused pid
/// cannot be mistaken for them), each readable once its process has exited.
struct Exits(Vec<(String, Option<OwnedFd>)>);

impl Exits {
    fn open(pids: &[u32]) -> Exits {
        Exits(
            pids.iter()
                .enumerate()
                .map(|(i, p)| {
                    let fd = rustix::process::Pid::from_raw(*p as i32).and_then(|pid| {
                        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
                    });
                    (format!("rank{i}"), fd)
                })
                .collect(),
        )
    }

    /// Seconds from `since` until each process exited (`None`: not within `within`; such
    /// a survivor is then SIGKILLed).
    fn wait(self, since: Instant, within: Duration) -> BTreeMap<String, Option<f64>> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let deadline = since + within;
        let mut out = BTreeMap::new();
        let mut left: Vec<(String, OwnedFd)> = Vec::new();
        for (name, fd) in self.0 {
            match fd {
                Some(fd) => left.push((name, fd)),
                // Already gone when we looked.
                None => {
                    out.insert(name, Some(0.0));
                }
            }
        }
        while !left.is_empty() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let mut fds: Vec<PollFd<'_>> = left
                .iter()
                .map(|(_, fd)| PollFd::from_borrowed_fd(fd.as_fd(), PollFlags::IN))
                .collect();
            let timeout = Timespec {
                tv_sec: remaining.as_secs() as i64,
                tv_nsec: i64::from(remaining.subsec_nanos()),
            };
            match poll(&mut fds, Some(&timeout)) {
                Ok(0) => break,
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => break,
            }
            let now = secs(since.elapsed());
            let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            let mut i = 0;
            left.retain(|(name, _)| {
                let done = ready[i];
                i += 1;
                if done {
                    out.insert(name.clone(), Some(now));
                }
                !done
            });
        }
        // Survivors are killed through their pidfds, which cannot reach a reused pid.
        for (name, fd) in left {
            let _ = rustix::process::pidfd_send_signal(&fd, rustix::process::Signal::KILL);
            out.insert(name, None);
        }
        out
    }
}
