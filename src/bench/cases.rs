//! Each measurement. Every group runs the real worker program with the built-in
//! components, on this machine, in this process.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rankexec_executor::{Dur, ExecuteError, ExecutorConfig, MultiProcessExecutor};
use rankexec_protocol::{
    Blob, Engine, EventType, FireEventError, FlContext, Shareable, Signal, Value,
};
use rankexec_sub_worker::builtins::checksum;

use super::report::Figure;

/// How a group is configured for the benchmark.
pub struct Setup<'a> {
    /// The worker program and its arguments.
    pub program: &'a str,
    /// Its arguments.
    pub args: &'a [String],
    /// Rank logs go here.
    pub logs: &'a Path,
    /// Ranks connect over TCP on 127.0.0.1 (encrypted records) instead of local sockets.
    pub tcp: bool,
}

impl Setup<'_> {
    /// A group of `n` ranks running the built-in component `path`.
    pub fn config(&self, n: u32, path: &str, args: serde_json::Value) -> ExecutorConfig {
        let mut c = ExecutorConfig::simple(n, path, args);
        c.worker.program = self.program.to_owned();
        c.worker.args = self.args.to_vec();
        c.log_dir = Some(self.logs.to_owned());
        c.gpu.mode = rankexec_executor::GpuMode::None;
        c.deadlines.heartbeat_timeout = Dur(Duration::from_secs(60));
        if self.tcp {
            c.transport = rankexec_executor::TransportConfig::Tcp {
                bind: "127.0.0.1:0".into(),
                advertise: None,
            };
        }
        c
    }

    fn group(&self, c: ExecutorConfig) -> anyhow::Result<(MultiProcessExecutor, FlContext)> {
        let exec = MultiProcessExecutor::new(c)?;
        let ctx = FlContext::new();
        exec.start(&ctx)?;
        Ok((exec, ctx))
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (a) Start-up: from `start()` until every rank is ready.
pub fn startup(s: &Setup<'_>, n: u32, reps: usize) -> anyhow::Result<Figure> {
    let mut samples = Vec::new();
    for _ in 0..reps {
        let exec = MultiProcessExecutor::new(s.config(n, "Echo", serde_json::json!({})))?;
        let t = Instant::now();
        exec.start(&FlContext::new())?;
        samples.push(ms(t.elapsed()));
        exec.finalize()?;
    }
    Ok(Figure::new("startup", Some(n), None, "ms", samples))
}

/// (b) Round trip of an empty task on a ready group.
pub fn roundtrip(s: &Setup<'_>, n: u32, reps: usize) -> anyhow::Result<Figure> {
    let (exec, mut ctx) = s.group(s.config(n, "Echo", serde_json::json!({})))?;
    let signal = Signal::new();
    for _ in 0..20 {
        exec.run_task("t", Shareable::new(), &mut ctx, &signal)?;
    }
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        exec.run_task("t", Shareable::new(), &mut ctx, &signal)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    exec.finalize()?;
    Ok(Figure::new("roundtrip_empty", Some(n), None, "us", samples))
}

/// The payload every fan-out sends: deterministic bytes.
pub fn payload(bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        let w = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
    v
}

/// Payloads from this size on are preceded by [`warm_memory`] in every timed step.
const WARM_FROM: usize = 64 << 20;

fn before_timed_step(bytes: usize) {
    if bytes >= WARM_FROM {
        warm_memory(2 * bytes);
    }
}

/// Touches `bytes` of fresh memory once and frees it.
///
/// On a VM with free-page reporting (this one: `page_reporting.page_reporting_order=11`
/// on the kernel command line), pages that stay free for about two seconds are handed
/// back to the host, and the next touch of each costs a host fault: far more than the
/// guest's page fault, and varying from run to run. Touching fresh memory just before a
/// timed step puts recently backed pages at the head of the free lists, so the step
/// measures the guest's own cost of fresh memory, as on bare metal. Both the memcpy
/// yardstick and every fan-out get the same treatment.
pub fn warm_memory(bytes: usize) {
    let mut v: Vec<u8> = Vec::with_capacity(bytes);
    v.resize(bytes, 1);
    std::hint::black_box(&v);
}

/// (c, yardstick) One memcpy of `bytes` into freshly allocated memory (what any copy
/// costs on this machine, page faults included), and into already-touched memory.
pub fn memcpy(src: &[u8], reps: usize) -> Figure {
    let mut fresh = Vec::new();
    let mut warm = Vec::new();
    let mut dst: Vec<u8> = vec![0u8; src.len()];
    for _ in 0..reps {
        before_timed_step(src.len());
        let t = Instant::now();
        let mut v: Vec<u8> = Vec::with_capacity(src.len());
        v.extend_from_slice(src);
        fresh.push(ms(t.elapsed()));
        std::hint::black_box(&v);
        drop(v);
        let t = Instant::now();
        dst.copy_from_slice(src);
        warm.push(ms(t.elapsed()));
        std::hint::black_box(&dst);
    }
    let (warm_median, _, _) = super::report::stats(&mut warm);
    Figure::new("memcpy", None, Some(src.len() as u64), "ms", fresh).with("warm_ms", warm_median)
}

/// (c) Fan-out: every rank receives the payload, rank 0 checks it and returns a digest.
/// `shared`: the payload was built in shared memory (`Blob::shared_with`); otherwise it
/// is ordinary memory and is copied into shared memory once per task.
pub fn fanout(
    s: &Setup<'_>,
    n: u32,
    data: &[u8],
    shared: bool,
    reps: usize,
) -> anyhow::Result<Figure> {
    let want = checksum(data) as i64;
    // Rank 0 checks the payload; the others only receive it.
    let (exec, mut ctx) = s.group(s.config(n, "Digest", serde_json::json!({"ranks": [0]})))?;
    let signal = Signal::new();
    let mut samples = Vec::new();
    let blob = if shared {
        Blob::shared_with(data.len(), |b| b.copy_from_slice(data))?
    } else {
        Blob::from(bytes::Bytes::copy_from_slice(data))
    };
    for rep in 0..=reps {
        let input = Shareable::new().with_blob("m", blob.clone());
        before_timed_step(data.len());
        let t = Instant::now();
        let out = exec.run_task("digest", input, &mut ctx, &signal)?;
        let dt = ms(t.elapsed());
        if out.meta("digest:m").and_then(Value::as_i64) != Some(want) {
            anyhow::bail!(
                "rank 0 computed a different digest for {} bytes",
                data.len()
            );
        }
        // The first run warms the ranks' code paths; it is not counted.
        if rep > 0 {
            samples.push(dt);
        }
    }
    exec.finalize()?;
    Ok(
        Figure::new("fanout", Some(n), Some(data.len() as u64), "ms", samples)
            .with("source", if shared { "shared" } else { "heap" }),
    )
}

struct Counter(AtomicU64);

impl Engine for Counter {
    fn fire_event(&self, _: &EventType, _: &mut FlContext) -> Result<(), FireEventError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn identity(&self) -> &str {
        "bench"
    }
    fn job_id(&self) -> &str {
        "bench"
    }
    fn workspace(&self) -> &Path {
        Path::new(".")
    }
}

/// (d) Events fired in ranks and relayed to the parent's engine, per second.
pub fn event_relay(s: &Setup<'_>, n: u32, per_rank: u64, reps: usize) -> anyhow::Result<Figure> {
    let exec = MultiProcessExecutor::new(s.config(
        n,
        "FireEvent",
        serde_json::json!({"event": "metric"}),
    ))?;
    let engine = Arc::new(Counter(AtomicU64::new(0)));
    let mut ctx = FlContext::with_engine(engine.clone());
    exec.start(&ctx)?;
    let signal = Signal::new();
    let mut samples = Vec::new();
    for _ in 0..reps {
        let before = engine.0.load(Ordering::Relaxed);
        let t = Instant::now();
        exec.run_task(
            "fire",
            Shareable::new().with_meta("count", per_rank),
            &mut ctx,
            &signal,
        )?;
        let secs = t.elapsed().as_secs_f64();
        let fired = engine.0.load(Ordering::Relaxed) - before;
        if fired != per_rank * u64::from(n) {
            anyhow::bail!(
                "{fired} events arrived, {} were fired",
                per_rank * u64::from(n)
            );
        }
        samples.push(fired as f64 / secs);
    }
    exec.finalize()?;
    Ok(
        Figure::new("event_relay", Some(n), None, "events/s", samples)
            .with("events_per_sample", per_rank * u64::from(n)),
    )
}

/// (e) Abort with a task in flight, until every rank is reaped (`finalize` returns).
/// Cooperative: ranks honour the abort and exit on `Close`. Forced: ranks ignore both the
/// abort and SIGTERM, and the graces are zero, so this measures SIGKILL and reaping.
pub fn abort(s: &Setup<'_>, n: u32, forced: bool, reps: usize) -> anyhow::Result<Figure> {
    let mut samples = Vec::new();
    for _ in 0..reps {
        let args = if forced {
            serde_json::json!({"secs": 60, "ignore_abort": true, "ignore_sigterm": true})
        } else {
            serde_json::json!({"secs": 60})
        };
        let mut c = s.config(n, "Sleep", args);
        if forced {
            c.deadlines.shutdown_grace = Dur(Duration::ZERO);
            c.deadlines.term_grace = Dur(Duration::ZERO);
        }
        let (exec, ctx) = s.group(c)?;
        let exec = Arc::new(exec);
        let e = exec.clone();
        let task = std::thread::spawn(move || {
            let mut ctx = ctx;
            e.run_task("sleep", Shareable::new(), &mut ctx, &Signal::new())
        });
        // Let every rank enter its task.
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        let report = exec.finalize()?;
        samples.push(ms(t.elapsed()));
        let _ = task.join();
        if !report.unkillable.is_empty() {
            anyhow::bail!("processes survived: {:?}", report.unkillable);
        }
    }
    let name = if forced {
        "abort_forced"
    } else {
        "abort_cooperative"
    };
    Ok(Figure::new(name, Some(n), None, "ms", samples))
}

/// (f) Crash detection: SIGKILL one rank mid-task; time until the task returns the
/// failure (every other rank stopped and reaped by then).
pub fn crash_detect(s: &Setup<'_>, n: u32, reps: usize) -> anyhow::Result<Figure> {
    let mut samples = Vec::new();
    for _ in 0..reps {
        let (exec, ctx) = s.group(s.config(n, "Sleep", serde_json::json!({"secs": 60})))?;
        let victim = *exec
            .live_pids()
            .last()
            .ok_or_else(|| anyhow::anyhow!("no ranks"))?;
        let exec = Arc::new(exec);
        let e = exec.clone();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let task = std::thread::spawn(move || {
            let mut ctx = ctx;
            let r = e.run_task("sleep", Shareable::new(), &mut ctx, &Signal::new());
            let _ = tx.send(Instant::now());
            r
        });
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim as i32),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        let returned = rx.recv_timeout(Duration::from_secs(30))?;
        samples.push(ms(returned - t));
        match task.join() {
            Ok(Err(ExecuteError::RankFailed { .. })) => {}
            Ok(other) => anyhow::bail!("expected a rank failure, got {other:?}"),
            Err(_) => anyhow::bail!("task thread panicked"),
        }
        exec.finalize()?;
    }
    Ok(Figure::new("crash_detect", Some(n), None, "ms", samples))
}

fn status_field(name: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// (g) The parent's peak resident memory while fanning `bytes` out to `n` ranks,
/// compared with the payload itself (held by the caller, so growth is at least 1x).
pub fn parent_peak_rss(s: &Setup<'_>, n: u32, bytes: usize) -> anyhow::Result<Figure> {
    let (exec, mut ctx) = s.group(s.config(n, "Digest", serde_json::json!({"ranks": [0]})))?;
    // Reset the high-water mark (writing 5 to clear_refs, Linux 4.0+).
    std::fs::write("/proc/self/clear_refs", "5")?;
    let baseline = status_field("VmRSS:");
    let data = payload(bytes);
    let out = exec.run_task(
        "digest",
        Shareable::new().with_blob("m", data),
        &mut ctx,
        &Signal::new(),
    )?;
    drop(out);
    let peak = status_field("VmHWM:");
    exec.finalize()?;
    let growth = peak.saturating_sub(baseline) as f64;
    Ok(Figure::new(
        "parent_peak_rss",
        Some(n),
        Some(bytes as u64),
        "bytes",
        vec![growth],
    )
    .with("ratio_to_payload", growth / bytes as f64))
}
