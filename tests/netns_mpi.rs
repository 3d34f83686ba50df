#![cfg(feature = "mpi")]
//! `mpirun` across two emulated nodes: this network namespace and another one, joined
//! by a veth pair (10.214.N.1 here, 10.214.N.2 there). Open MPI starts its daemon on the
//! other node through `python/tests/two_nodes.py rsh` (standing in for ssh), the ranks
//! reach the host over the encrypted TCP transport, and `MpiDigitsTrainer` all-reduces
//! its gradients across both namespaces over Open MPI's TCP transport to the stated
//! accuracy. Nothing is left in the other namespace afterwards.
//!
//! Needs root, `ip` (iproute2), `mpirun` and `python3`; each test prints `SKIPPED:` and
//! why otherwise. The namespace is deleted (its processes killed first) even when the
//! test fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{
    Dur, ExecutorConfig, LauncherConfig, MultiProcessExecutor, TransportConfig,
};
use rankexec::protocol::{Shareable, Signal, Value};

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The other node; deleted (processes killed first) when dropped.
struct Node {
    ns: String,
    host_if: String,
    peer_if: String,
    host: String,
    peer: String,
}

impl Node {
    fn up() -> Result<Node, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("network namespaces need root".into());
        }
        let n = 100 + std::process::id() % 100;
        let node = Node {
            ns: format!("rxmpi{n}"),
            host_if: format!("rxmh{n}"),
            peer_if: format!("rxmp{n}"),
            host: format!("10.214.{n}.1"),
            peer: format!("10.214.{n}.2"),
        };
        node.teardown(); // a leftover of an earlier, killed run
        let (ns, h, p) = (&node.ns, &node.host_if, &node.peer_if);
        ip(&["netns", "add", ns])?;
        ip(&["link", "add", h, "type", "veth", "peer", "name", p])?;
        ip(&["link", "set", p, "netns", ns])?;
        ip(&["addr", "add", &format!("{}/24", node.host), "dev", h])?;
        ip(&["link", "set", h, "up"])?;
        let peer = format!("{}/24", node.peer);
        for cmd in [
            vec!["addr", "add", peer.as_str(), "dev", p],
            vec!["link", "set", p, "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut args = vec!["netns", "exec", ns.as_str(), "ip"];
            args.extend(cmd);
            ip(&args)?;
        }
        Ok(node)
    }

    fn pids(&self) -> Vec<u32> {
        ip(&["netns", "pids", &self.ns])
            .map(|t| {
                t.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn teardown(&self) {
        for p in self.pids() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = ip(&["netns", "del", &self.ns]);
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn on_path(prog: &str) -> bool {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .any(|d| d.join(prog).is_file())
}

fn helper() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/two_nodes.py")
}

/// The MPI example's configuration, its ranks launched across both nodes.
fn config(node: &Node, logs: &Path) -> ExecutorConfig {
    let text = include_str!("../examples/mpi/executor.json");
    let mut c: ExecutorConfig = serde_json::from_str(text).expect("the example config parses");
    c.worker.program = rankexec_bin().display().to_string();
    c.worker.args = vec!["worker".into()];
    c.log_dir = Some(logs.to_owned());
    c.launcher = LauncherConfig::Command {
        argv: [
            "python3",
            &helper().display().to_string(),
            "mpirun",
            &node.ns,
            &node.host,
            &node.peer,
            "{nproc}",
            "{program}",
            "{args}",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        rank_source: Some("openmpi".into()),
    };
    c.transport = TransportConfig::Tcp {
        bind: format!("{}:0", node.host),
        advertise: None,
    };
    c.deadlines.startup = Dur(Duration::from_secs(120));
    c.deadlines.task = Dur(Duration::from_secs(300));
    c.deadlines.heartbeat_timeout = Dur(Duration::from_secs(20));
    c.restart.max_restarts = 0;
    c
}

fn environ_has(pid: u32, key: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|kv| {
        String::from_utf8_lossy(kv)
            .strip_prefix(&format!("{key}="))
            .map(str::to_owned)
    })
}

#[test]
fn mpirun_trains_across_two_namespaces() {
    for prog in ["ip", "mpirun", "python3"] {
        if !on_path(prog) {
            eprintln!("SKIPPED: {prog} is not installed");
            return;
        }
    }
    let node = match Node::up() {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIPPED: cannot make a second node here: {why}");
            return;
        }
    };
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(config(&node, logs.path())).unwrap();
    let mut ctx = start(&exec);
    // A rank lives in the other namespace, with the rank Open MPI gave it.
    let there: Vec<String> = node
        .pids()
        .into_iter()
        .filter_map(|p| environ_has(p, "OMPI_COMM_WORLD_RANK"))
        .collect();
    assert_eq!(there, ["1"], "rank 1 runs in {}", node.ns);
    let mut accuracy = 0.0;
    for round in 0..2 {
        let out = exec
            .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
            .unwrap_or_else(|e| panic!("round {round}: {}", chain(&e)));
        assert_eq!(out.meta("mpi_world_size"), Some(&Value::Int(2)));
        accuracy = out
            .meta("test_accuracy")
            .and_then(Value::as_f64)
            .expect("test_accuracy");
    }
    assert!(accuracy >= 0.95, "test_accuracy {accuracy}");
    exec.finalize().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.pids().is_empty() {
        assert!(
            Instant::now() < deadline,
            "left in {}: {:?}",
            node.ns,
            node.pids()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "mpirun across {} and this namespace: rank 1 there, test_accuracy {accuracy:.3} after 2 rounds; nothing left there",
        node.ns
    );
}
