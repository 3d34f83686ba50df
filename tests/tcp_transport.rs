//! The TCP transport: ranks connect to `tcp:HOST:PORT` and authenticate with the
//! launch's secret; large blobs travel inline (memory files cannot cross TCP); a
//! connection without the secret is refused while the group keeps working.

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{MultiProcessExecutor, TransportConfig};
use rankexec::protocol::wire::{
    Channel, Endpoint, HandshakeError, Identity, Secret, client_handshake,
};
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
    let exec = MultiProcessExecutor::new(tcp_config(2, "Echo", logs.path())).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let (text, endpoint) = tcp_endpoint(&exec);

    let conn = endpoint
        .connect(Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("TCP connect to {text}: {e}"));
    let impostor = Identity {
        channel: Channel::Exec,
        rank: 0,
        world_size: 2,
        launch_id: "not-the-launch".into(),
        pid: std::process::id(),
        pgid: std::process::id(),
        host: "impostor".into(),
    };
    let wrong = Secret::from_hex(&"ab".repeat(32)).unwrap();
    let err = client_handshake(&conn, &wrong, &impostor, Duration::from_secs(5)).unwrap_err();
    match &err {
        HandshakeError::Refused { reason } => assert_eq!(reason, "authentication failed"),
        other => panic!("expected a refusal, got {other:?}: {other}"),
    }
    drop(conn);
    assert!(
        log.wait_for(
            "refused connection: authentication failed",
            Duration::from_secs(5)
        ),
        "the parent logs the refusal"
    );

    // The real ranks were not disturbed.
    assert_eq!(exec.live_pids(), pids);
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
    exec.finalize().unwrap();
    assert_gone(&pids, "ranks after finalize");
}
