//! `rankexec-pydriver`: a host for the Python ranks' tests and benchmarks.
//!
//! It owns one `MultiProcessExecutor` and obeys JSON lines on stdin, answering each with
//! one JSON line on stdout, so a pytest test (or the benchmark script) can start a
//! group, send tasks with large blobs, abort them, fire events and stop the group, and
//! check what the OS and the executor say. Commands (`op`):
//!
//! - `start {config, engine}`: launch the group; answers `ms` and the group's `pids`;
//!   with `engine: true` the host has an engine that records the ranks' events
//!   (`events` lists them as `[event, rank]`);
//! - `task {task, meta, blobs: {name: {len, byte}}, abort_after_ms}`: run a task whose
//!   blobs are built in shared memory (their `inode`s are returned as `input_inodes`);
//!   answers the output's `meta` and, per blob, `len`, `shared`, `inode`, `first`,
//!   `last`, or the error's `class`, `rank`, `error` and `report`;
//!   With `events_during {event, n, after_path, abort_after_answers, abort_after_ms}`,
//!   `n` events are fired at once while the task runs (once `after_path` exists), the
//!   task is aborted once `abort_after_answers` of them are answered (or
//!   `abort_after_ms` after firing), and `events` lists their answers;
//! - `event {event}`: fire an event to every rank;
//! - `pids`: the group's live pids;
//! - `rtt {task, n}`: `n` empty tasks back to back; answers each one's microseconds;
//! - `fanout {task, len, n}`: `n` tasks (after one warm-up) each carrying a blob of
//!   `len` bytes built in shared memory; rank 0 must answer the sum of its
//!   little-endian u64 words as `meta.sum` (a decimal string). Each is followed by a
//!   memcpy of the same size in this process (into fresh and into touched memory),
//!   unless `yardstick: false`; the warm-up task counts only then;
//! - `rss`: this process's `VmRSS` and `VmHWM`; `reset_peak`: resets `VmHWM`;
//! - `stop`: finalize the group.
//!
//! Errors never end the driver; they are answers (`ok: false`). End of stdin stops it.

use std::io::{BufRead, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rankexec_executor::{ExecuteError, ExecutorConfig, MultiProcessExecutor};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use rankexec_protocol::{
    Blob, Engine, EventType, FireEventError, FlContext, Shareable, Signal, Value, error_chain, keys,
};
use serde_json::{Value as Json, json};

fn inode(blob: &Blob) -> Option<u64> {
    let fd = blob.memfd()?;
    std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .ok()
        .map(|m| m.ino())
}

fn error_json(e: &ExecuteError) -> Json {
    let root = e.root_cause();
    json!({
        "ok": false,
        "class": e.class().as_str(),
        "error": error_chain(e),
        "rank": root.map(|f| f.rank),
        "report": root.map(|f| f.report()),
        "aborted": matches!(e, ExecuteError::Aborted { .. }),
        "forced": matches!(e, ExecuteError::Aborted { forced: true, .. }),
    })
}

fn shared_blob(len: usize, byte: u8) -> anyhow::Result<Blob> {
    Ok(Blob::shared_with(len, |b| b.fill(byte))?)
}

fn build_input(cmd: &Json) -> anyhow::Result<(Shareable, Json)> {
    let mut input = Shareable::new();
    if let Some(m) = cmd["meta"].as_object() {
        for (k, v) in m {
            input.set_meta(k.clone(), Value::from_json(v));
        }
    }
    let mut inodes = serde_json::Map::new();
    if let Some(b) = cmd["blobs"].as_object() {
        for (name, spec) in b {
            let len = spec["len"].as_u64().context("blob len")? as usize;
            let byte = spec["byte"].as_u64().unwrap_or(0) as u8;
            let blob = shared_blob(len, byte)?;
            inodes.insert(name.clone(), json!(inode(&blob)));
            input.set_blob(name.clone(), blob);
        }
    }
    Ok((input, Json::Object(inodes)))
}

fn output_json(out: &Shareable) -> Json {
    let meta: serde_json::Map<String, Json> = out
        .meta_map()
        .iter()
        .map(|(k, v)| (k.clone(), v.to_json()))
        .collect();
    let blobs: serde_json::Map<String, Json> = out
        .blobs()
        .iter()
        .map(|(k, b)| {
            (
                k.clone(),
                json!({"len": b.len(), "shared": b.is_shared(), "inode": inode(b),
                       "first": b.first(), "last": b.last()}),
            )
        })
        .collect();
    json!({"meta": meta, "blobs": blobs})
}

/// Touches `bytes` of fresh memory once and frees it, so that a timed step that
/// allocates gets recently backed pages (see `rankexec bench`'s method on VMs with
/// free-page reporting); the yardstick and the fan-out get the same treatment.
fn warm_memory(bytes: usize) {
    if bytes >= 128 << 20 {
        let mut v: Vec<u8> = Vec::with_capacity(bytes);
        v.resize(bytes, 1);
        std::hint::black_box(&v);
    }
}

fn status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// `events_during` of a `task`: once the file `after_path` exists (60 s at most), fires
/// `n` events `event` to the ranks at once (one thread each); triggers the task's abort
/// once `abort_after_answers` of them are answered, or `abort_after_ms` after firing.
/// Answers every event's `ok` and `error`, in answer order.
fn fire_during(exec: &MultiProcessExecutor, d: &Json, signal: &Signal) -> Json {
    let event = EventType::new(d["event"].as_str().unwrap_or("custom"));
    let n = d["n"].as_u64().unwrap_or(1);
    let abort_after = d["abort_after_answers"].as_u64();
    if let Some(path) = d["after_path"].as_str() {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !Path::new(path).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    std::thread::scope(|s| {
        if let Some(ms) = d["abort_after_ms"].as_u64() {
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(ms));
                signal.trigger("aborted by the test after the events");
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..n {
            let (tx, event) = (tx.clone(), event.clone());
            s.spawn(move || {
                let r = exec.fire_to_ranks(&event, &mut FlContext::new());
                let _ = tx.send(r.map_err(|e| error_chain(&e)));
            });
        }
        drop(tx);
        let mut answers = Vec::new();
        for r in rx {
            answers.push(match r {
                Ok(()) => json!({"ok": true}),
                Err(e) => json!({"ok": false, "error": e}),
            });
            if Some(answers.len() as u64) == abort_after {
                signal.trigger("aborted by the test after event answers");
            }
        }
        json!(answers)
    })
}

fn exec_of(e: &Option<MultiProcessExecutor>) -> anyhow::Result<&MultiProcessExecutor> {
    e.as_ref().context("no group: send `start` first")
}

struct Driver {
    exec: Option<MultiProcessExecutor>,
    ctx: FlContext,
    events: Arc<Recorder>,
}

/// A host engine that records the events ranks fire: `(event, rank)`.
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, i64)>>);

impl Engine for Recorder {
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError> {
        let rank = ctx
            .get_prop(keys::FROM_RANK_NUMBER)
            .and_then(Value::as_i64)
            .unwrap_or(-1);
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((event.as_str().to_owned(), rank));
        Ok(())
    }
    fn identity(&self) -> &str {
        "pydriver"
    }
    fn job_id(&self) -> &str {
        "pydriver"
    }
    fn workspace(&self) -> &Path {
        Path::new(".")
    }
}

impl Driver {
    fn handle(&mut self, cmd: &Json) -> anyhow::Result<Json> {
        match cmd["op"].as_str().unwrap_or_default() {
            "start" => {
                let cfg: ExecutorConfig = serde_json::from_value(cmd["config"].clone())
                    .context("invalid executor config")?;
                let exec = MultiProcessExecutor::new(cfg)?;
                self.ctx = if cmd["engine"].as_bool().unwrap_or(false) {
                    FlContext::with_engine(self.events.clone())
                } else {
                    FlContext::new()
                };
                let t = Instant::now();
                let r = exec.start(&self.ctx);
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let pids = exec.live_pids();
                self.exec = Some(exec);
                Ok(match r {
                    Ok(()) => json!({"ok": true, "ms": ms, "pids": pids}),
                    Err(e) => json!({"ok": false, "ms": ms, "error": error_chain(&e)}),
                })
            }
            "task" => {
                let (input, inodes) = build_input(cmd)?;
                let task = cmd["task"].as_str().unwrap_or("task").to_owned();
                let signal = Signal::new();
                if let Some(ms) = cmd["abort_after_ms"].as_u64() {
                    let s = signal.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(ms));
                        s.trigger("aborted by the test");
                    });
                }
                let exec = exec_of(&self.exec)?;
                let during = cmd.get("events_during").filter(|d| d.is_object());
                let ctx = &mut self.ctx;
                let t = Instant::now();
                let (r, ms, fired) = std::thread::scope(|s| {
                    let fired = during.map(|d| {
                        let signal = signal.clone();
                        s.spawn(move || fire_during(exec, d, &signal))
                    });
                    let r = exec.run_task(&task, input, ctx, &signal);
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    (
                        r,
                        ms,
                        fired.map(|h| h.join().unwrap_or_else(|_| json!("panicked"))),
                    )
                });
                let mut j = match r {
                    Ok(out) => {
                        let mut j = output_json(&out);
                        j["ok"] = json!(true);
                        j["input_inodes"] = inodes;
                        j
                    }
                    Err(e) => error_json(&e),
                };
                j["ms"] = json!(ms);
                if let Some(f) = fired {
                    j["events"] = f;
                }
                Ok(j)
            }
            "event" => {
                let ev = EventType::new(cmd["event"].as_str().unwrap_or("custom"));
                Ok(
                    match exec_of(&self.exec)?.fire_to_ranks(&ev, &mut self.ctx) {
                        Ok(()) => json!({"ok": true}),
                        Err(e) => json!({"ok": false, "error": error_chain(&e)}),
                    },
                )
            }
            "events" => {
                let ev = self.events.0.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(json!({"ok": true, "events": *ev}))
            }
            "pids" => Ok(json!({"ok": true, "pids": exec_of(&self.exec)?.live_pids()})),
            "rss" => Ok(json!({"ok": true, "rss_kib": status_kib("VmRSS:"),
                               "peak_kib": status_kib("VmHWM:")})),
            "rtt" => {
                let n = cmd["n"].as_u64().unwrap_or(100);
                let task = cmd["task"].as_str().unwrap_or("task").to_owned();
                let exec = exec_of(&self.exec)?;
                let mut us = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let t = Instant::now();
                    if let Err(e) =
                        exec.run_task(&task, Shareable::new(), &mut self.ctx, &Signal::new())
                    {
                        return Ok(error_json(&e));
                    }
                    us.push(t.elapsed().as_secs_f64() * 1e6);
                }
                Ok(json!({"ok": true, "us": us}))
            }
            "fanout" => {
                let len = cmd["len"].as_u64().context("len")? as usize;
                let n = cmd["n"].as_u64().unwrap_or(3);
                let task = cmd["task"].as_str().unwrap_or("task").to_owned();
                let exec = exec_of(&self.exec)?;
                let (mut task_ms, mut fresh_ms, mut warm_ms) = (Vec::new(), Vec::new(), Vec::new());
                // Without the yardstick, nothing but the blob is allocated here (for the
                // parent's memory figure).
                let yardstick = cmd["yardstick"].as_bool().unwrap_or(true);
                let (src, mut dst) = if yardstick {
                    (vec![1u8; len], vec![2u8; len])
                } else {
                    (Vec::new(), Vec::new())
                };
                for i in 0..=n {
                    let byte = (i % 251) as u8 + 1;
                    let blob = shared_blob(len, byte)?;
                    let want = (len as u64 / 8).wrapping_mul(u64::from_le_bytes([byte; 8]));
                    let input = Shareable::new().with_blob("x", blob);
                    if yardstick {
                        warm_memory(2 * len);
                    }
                    let t = Instant::now();
                    let out = match exec.run_task(&task, input, &mut self.ctx, &Signal::new()) {
                        Ok(out) => out,
                        Err(e) => return Ok(error_json(&e)),
                    };
                    let dt = t.elapsed().as_secs_f64() * 1e3;
                    let sum = out.meta("sum").and_then(Value::as_str).unwrap_or_default();
                    anyhow::ensure!(
                        sum == want.to_string(),
                        "rank 0 read {sum}, expected {want}"
                    );
                    if !yardstick {
                        task_ms.push(dt);
                        continue;
                    }
                    // The first task warms the ranks' code paths; it is not counted.
                    if i == 0 {
                        continue;
                    }
                    task_ms.push(dt);
                    // The yardstick: one memcpy into fresh memory (as any copy pays), and
                    // into memory already touched.
                    warm_memory(2 * len);
                    let t = Instant::now();
                    let mut v: Vec<u8> = Vec::with_capacity(len);
                    v.extend_from_slice(&src);
                    fresh_ms.push(t.elapsed().as_secs_f64() * 1e3);
                    std::hint::black_box(&v);
                    drop(v);
                    let t = Instant::now();
                    dst.copy_from_slice(&src);
                    warm_ms.push(t.elapsed().as_secs_f64() * 1e3);
                    std::hint::black_box(&dst);
                }
                Ok(
                    json!({"ok": true, "task_ms": task_ms, "memcpy_ms": fresh_ms,
                          "memcpy_warm_ms": warm_ms}),
                )
            }
            "reset_peak" => {
                // Resets VmHWM to the current RSS (proc(5), clear_refs).
                std::fs::write("/proc/self/clear_refs", "5")?;
                Ok(json!({"ok": true}))
            }
            "stop" => {
                let t = Instant::now();
                let report = exec_of(&self.exec)?.finalize()?;
                Ok(json!({"ok": true, "ms": t.elapsed().as_secs_f64() * 1e3,
                          "unkillable": report.unkillable}))
            }
            other => anyhow::bail!("unknown op `{other}`"),
        }
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RANKEXEC_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let mut driver = Driver {
        exec: None,
        ctx: FlContext::new(),
        events: Arc::default(),
    };
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let answer = match serde_json::from_str::<Json>(&line) {
            Ok(cmd) => driver
                .handle(&cmd)
                .unwrap_or_else(|e| json!({"ok": false, "error": format!("{e:#}")})),
            Err(e) => json!({"ok": false, "error": format!("not JSON: {e}")}),
        };
        let mut out = stdout.lock();
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    if let Some(exec) = driver.exec.take() {
        let _ = exec.finalize();
    }
    Ok(())
}
