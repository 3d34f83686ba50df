//! The TCP transport: ranks connect to `tcp:HOST:PORT` and authenticate with the
//! launch's secret; large blobs travel inline (memory files cannot cross TCP); a
//! connection without the secret is refused while the group keeps working. After the
//! handshake every byte is in encrypted, authenticated records: a man in the middle
//! can neither read a frame, inject one (a forged result) nor replay one.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{MultiProcessExecutor, TransportConfig};
use rankexec::protocol::wire::message::{TaskOutput, WireShareable};
use rankexec::protocol::wire::{Endpoint, Message, envelope};
use rankexec::protocol::{Shareable, Signal, Value};

fn tcp_config(n: u32, path: &str, logs: &std::path::Path) -> rankexec::executor::ExecutorConfig {
    let mut c = config(n, path, serde_json::json!({}), logs);
    c.transport = TransportConfig::Tcp {
        bind: "127.0.0.1:0".into(),
        advertise: None,
    };
    c
}

/// The group's endpoint: `tcp:127.0.0.1:PORT` with the port actually bound.
fn tcp_endpoint(exec: &MultiProcessExecutor) -> (String, Endpoint) {
    let text = exec
        .status()
        .endpoint
        .expect("a running group has an endpoint");
    let port = text
        .strip_prefix("tcp:127.0.0.1:")
        .unwrap_or_else(|| panic!("a TCP endpoint on 127.0.0.1, got {text}"));
    assert_ne!(port.parse::<u16>().unwrap(), 0, "port 0 became a real port");
    let ep: Endpoint = text.parse().unwrap();
    assert!(matches!(ep, Endpoint::Tcp(_)));
    (text, ep)
}

#[test]
fn tasks_and_large_blobs_over_tcp() {
    let logs = tempfile::tempdir().unwrap();
    let cfg = tcp_config(2, "Echo", logs.path());
    let threshold = cfg.zero_copy_threshold.bytes() as usize;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    tcp_endpoint(&exec);
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
    // Larger than the zero-copy threshold: over TCP it must travel inline, both ways.
    let big: Vec<u8> = (0..(threshold * 16 + 3))
        .map(|i| (i * 31 + 7) as u8)
        .collect();
    let out = exec
        .run_task(
            "echo",
            Shareable::new().with_blob("m", big.clone()),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    let m = out.blob("m").expect("the blob came back");
    assert!(!m.is_shared(), "no memory file crosses a TCP connection");
    assert_eq!(m.len(), big.len());
    assert!(m[..] == big[..], "the blob is intact");
    exec.finalize().unwrap();
}

#[test]
fn large_input_reaches_every_rank_inline_over_tcp() {
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(tcp_config(3, "Digest", logs.path())).unwrap();
    let mut ctx = start(&exec);
    let big: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let out = exec
        .run_task(
            "digest",
            Shareable::new().with_blob("big", big.clone()),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(
        out.meta("shared:big"),
        Some(&Value::Bool(false)),
        "2 MiB went inline over TCP"
    );
    assert_eq!(out.meta("bytes:big"), Some(&Value::Int(big.len() as i64)));
    exec.finalize().unwrap();
}

#[test]
fn wrong_secret_over_tcp_is_refused_and_the_group_keeps_working() {
    let log = LogCapture::install();
    let logs = tempfile::tempdir().unwrap();
    // Rank 0's program first runs an impostor over TCP (same endpoint, wrong secret),
    // then becomes the real rank: the impostor meets the acceptor during start-up (once
    // the group is ready the listener is closed).
    let script = logs.path().join("worker.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nif [ \"$RANKEXEC_RANK\" = 0 ]; then env -u RANKEXEC_SECRET_FD -u RANKEXEC_PARENT_PID RANKEXEC_SECRET={} RANKEXEC_CONNECT_TIMEOUT_MS=3000 {w}; fi\nexec {w}\n",
            "ab".repeat(32),
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = tcp_config(2, "Echo", logs.path());
    cfg.worker.program = script.display().to_string();
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    assert!(
        log.wait_for(
            "refused connection: authentication failed",
            Duration::from_secs(5)
        ),
        "the parent logs the refusal"
    );
    let rank0 = std::fs::read_to_string(logs.path().join("rank-0/stderr.log")).unwrap();
    assert!(
        rank0.contains("refused by the parent: authentication failed"),
        "the impostor was told why: {rank0}"
    );
    let (text, endpoint) = tcp_endpoint(&exec);
    let out = exec
        .run_task(
            "echo",
            Shareable::new().with_meta("after", true),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(out.meta("after"), Some(&Value::Bool(true)));
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    // Ready: the port is closed.
    assert!(
        endpoint.connect(Duration::from_secs(1)).is_err(),
        "{text} still accepts after start-up"
    );
    exec.finalize().unwrap();
    assert_gone(&pids, "ranks after finalize");
}

/// A man in the middle between rank 0 and the parent: forwards both ways, records
/// what rank 0 sends on its first connection (the exec channel) and can write extra
/// bytes towards the parent on it.
struct Mitm {
    port: u16,
    captured: Arc<Mutex<Vec<u8>>>,
    to_parent: Arc<Mutex<Option<TcpStream>>>,
}

impl Mitm {
    fn start(real_endpoint_file: PathBuf) -> Mitm {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let captured = Arc::new(Mutex::new(Vec::new()));
        let to_parent: Arc<Mutex<Option<TcpStream>>> = Arc::new(Mutex::new(None));
        let (cap, tp) = (captured.clone(), to_parent.clone());
        std::thread::spawn(move || {
            for (index, rank_side) in listener.incoming().enumerate() {
                let Ok(rank_side) = rank_side else { return };
                let deadline = Instant::now() + Duration::from_secs(10);
                let real = loop {
                    if let Ok(t) = std::fs::read_to_string(&real_endpoint_file) {
                        break t.trim().trim_start_matches("tcp:").to_owned();
                    }
                    assert!(Instant::now() < deadline, "no real endpoint");
                    std::thread::sleep(Duration::from_millis(5));
                };
                let Ok(parent_side) = TcpStream::connect(&real) else {
                    return;
                };
                if index == 0 {
                    *tp.lock().unwrap() = Some(parent_side.try_clone().unwrap());
                }
                let pump =
                    |mut from: TcpStream, mut to: TcpStream, tap: Option<Arc<Mutex<Vec<u8>>>>| {
                        std::thread::spawn(move || {
                            let mut buf = [0u8; 65536];
                            loop {
                                let n = match from.read(&mut buf) {
                                    Ok(0) | Err(_) => break,
                                    Ok(n) => n,
                                };
                                if let Some(t) = &tap {
                                    t.lock().unwrap().extend_from_slice(&buf[..n]);
                                }
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    };
                pump(
                    rank_side.try_clone().unwrap(),
                    parent_side.try_clone().unwrap(),
                    (index == 0).then(|| cap.clone()),
                );
                pump(parent_side, rank_side, None);
            }
        });
        Mitm {
            port,
            captured,
            to_parent,
        }
    }

    fn inject(&self, bytes: &[u8]) {
        let mut g = self.to_parent.lock().unwrap();
        g.as_mut()
            .expect("rank 0's exec connection")
            .write_all(bytes)
            .unwrap();
    }
}

/// A one-rank `Sleep` group over TCP whose rank connects through a [`Mitm`].
fn behind_a_mitm(logs: &Path) -> (MultiProcessExecutor, Mitm) {
    let real = logs.join("real-endpoint");
    let mitm = Mitm::start(real.clone());
    let script = logs.join("worker.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$RANKEXEC_ENDPOINT\" > {r}.tmp && mv {r}.tmp {r}\nRANKEXEC_ENDPOINT=tcp:127.0.0.1:{p} exec {w}\n",
            r = real.display(),
            p = mitm.port,
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = tcp_config(1, "Sleep", logs);
    cfg.components[0].args = serde_json::json!({"secs": 0});
    cfg.worker.program = script.display().to_string();
    cfg.restart.max_restarts = 0;
    (MultiProcessExecutor::new(cfg).unwrap(), mitm)
}

/// Waits until rank 0 logs that it is inside its `n`th task.
fn wait_in_task(logs: &Path, n: usize) {
    let file = logs.join("rank-0/stderr.log");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&file).map_or(0, |t| t.matches("sleeping").count()) < n {
        assert!(Instant::now() < deadline, "rank 0 never started task {n}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_injected_task_result_is_refused() {
    let logs = tempfile::tempdir().unwrap();
    let (exec, mitm) = behind_a_mitm(logs.path());
    let mut ctx = start(&exec);
    let exec = Arc::new(exec);
    let e2 = exec.clone();
    let task = std::thread::spawn(move || {
        e2.run_task(
            "train",
            Shareable::new().with_meta("secs", 5.0),
            &mut ctx,
            &Signal::new(),
        )
    });
    wait_in_task(logs.path(), 1);
    // While the rank trains, someone on the path forges its result: a well-formed
    // plaintext TaskResult frame for every likely task id, carrying a poisoned model.
    let mut forged = Vec::new();
    for task_id in 0..4 {
        let poisoned = WireShareable {
            meta: [("poisoned".to_owned(), Value::Bool(true))].into(),
            blobs: vec![],
        };
        let msg = Message::TaskResult {
            task_id,
            outcome: Ok(TaskOutput {
                props: Default::default(),
                output: poisoned,
            }),
        };
        forged.extend(envelope::plain(&msg).unwrap().to_vec());
    }
    // Framed as a record (a plausible length, a made-up tag), so it gets past the
    // length check and meets authentication.
    let mut record = ((forged.len() + 16) as u32).to_le_bytes().to_vec();
    record.extend_from_slice(&forged);
    record.extend_from_slice(&[0u8; 16]);
    mitm.inject(&record);
    let out = task.join().unwrap();
    let err = match out {
        Ok(s) => panic!("the forged result was accepted: {:?}", s.meta_map()),
        Err(e) => e,
    };
    let text = chain(&err);
    assert!(text.contains("authentication failed"), "{text}");
    eprintln!("injected TaskResult: {text}");
}

#[test]
fn a_replayed_task_result_is_refused() {
    let logs = tempfile::tempdir().unwrap();
    let (exec, mitm) = behind_a_mitm(logs.path());
    let mut ctx = start(&exec);
    // Task 1 runs normally; what rank 0 sent on its exec channel during it is its
    // (encrypted) result.
    mitm.captured.lock().unwrap().clear();
    let first = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(first.meta("rank"), Some(&Value::Int(0)));
    let recorded = std::mem::take(&mut *mitm.captured.lock().unwrap());
    assert!(!recorded.is_empty(), "the result was seen on the wire");
    assert!(
        !recorded.windows(4).any(|w| w == b"RXF1"),
        "no plaintext frame crosses the wire"
    );
    // Task 2: while the rank works, the recorded result is played again.
    let exec = Arc::new(exec);
    let e2 = exec.clone();
    let task = std::thread::spawn(move || {
        e2.run_task(
            "train",
            Shareable::new().with_meta("secs", 5.0),
            &mut ctx,
            &Signal::new(),
        )
    });
    wait_in_task(logs.path(), 2);
    mitm.inject(&recorded);
    let err = match task.join().unwrap() {
        Ok(s) => panic!("the replayed result was accepted: {:?}", s.meta_map()),
        Err(e) => e,
    };
    let text = chain(&err);
    assert!(text.contains("authentication failed"), "{text}");
    eprintln!(
        "replayed {} bytes of an earlier TaskResult: {text}",
        recorded.len()
    );
}
