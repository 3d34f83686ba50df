//! torchrun's GPU numbering, as each rank's environment says it, under every launcher.
//!
//! A site with eight GPUs of distinct free memory (a declared inventory: no GPU is
//! needed) places 1 to 8 ranks best fit, least headroom first, which is neither the
//! index order nor its reverse. Each rank's program is a wrapper that writes the
//! environment it was started with, then runs the real worker. Whatever the launcher
//! (the builtin one, torchrun, mpirun), index `LOCAL_RANK` of the rank's
//! `CUDA_VISIBLE_DEVICES` must be the GPU placed for that rank, with
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID`: the contract `torch.cuda.set_device(LOCAL_RANK)`,
//! `DDP(device_ids=[local_rank])`, Lightning and Hugging Face rely on. `isolated` mode
//! keeps one GPU per rank (device 0 everywhere) and is refused with external launchers.
//! srun: `tests/slurm.rs::srun_ranks_number_gpus_as_torchrun` (under `scripts/slurm-test.sh`).

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rankexec::executor::admission::Admission;
use rankexec::executor::admission::host::SysinfoHost;
use rankexec::executor::admission::ledger::Ledger;
use rankexec::executor::gpu::{FixedInventory, GpuInfo, Inventory};
use rankexec::executor::{
    ByteSize, Dur, ExecutorConfig, GpuMode, LauncherConfig, MultiProcessExecutor,
};
use rankexec::protocol::{Shareable, Signal};

const GIB: u64 = 1 << 30;
/// Free GiB of GPU `i` (of 80): best fit takes 3, 1, 5, 2, 4, 7, 6, 0.
const FREE: [u64; 8] = [70, 24, 38, 18, 46, 30, 62, 54];

fn uuid(i: usize) -> String {
    format!("GPU-5e0c{i}a1-0000-4000-8000-00000000000{i}")
}

fn inventory() -> Inventory {
    Inventory::Gpus {
        driver: Some("declared".into()),
        gpus: FREE
            .iter()
            .enumerate()
            .map(|(i, free)| GpuInfo {
                index: i as u32,
                uuid: uuid(i),
                name: "declared GPU".into(),
                memory_total: 80 * GIB,
                memory_free: free * GIB,
                memory_used: (80 - free) * GIB,
                utilization_gpu: None,
                utilization_memory: None,
                processes: vec![],
            })
            .collect(),
    }
}

/// The UUID best fit gives rank `rank`.
fn placed(rank: usize) -> String {
    let mut order: Vec<usize> = (0..FREE.len()).collect();
    order.sort_by_key(|i| FREE[*i]);
    uuid(order[rank])
}

/// A rank program that writes its environment to `dir/env.<pid>`, then runs the worker.
fn wrapper(dir: &Path) -> PathBuf {
    let script = dir.join("rank.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nenv > \"{d}/env.$$.tmp\" && mv \"{d}/env.$$.tmp\" \"{d}/env.$$\"\nexec \"{w}\" \"$@\"\n",
            d = dir.display(),
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn read_envs(dir: &Path) -> Vec<BTreeMap<String, String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("env.") || name.ends_with(".tmp") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap();
        out.push(
            text.lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        );
    }
    out
}

fn num(env: &BTreeMap<String, String>, keys: &[&str]) -> usize {
    keys.iter()
        .find_map(|k| env.get(*k))
        .unwrap_or_else(|| panic!("none of {keys:?} in {env:?}"))
        .parse()
        .unwrap()
}

fn launcher_dir(name: &str) -> Option<PathBuf> {
    if let Some(py) = std::env::var_os("RANKEXEC_TEST_PYTHON")
        && let Some(dir) = Path::new(&py).parent()
        && dir.join(name).is_file()
    {
        return Some(dir.to_owned());
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .find(|d| d.join(name).is_file())
}

fn group_config(world: u32, dir: &Path, launcher: LauncherConfig, mode: GpuMode) -> ExecutorConfig {
    let mut c = config(world, "Echo", serde_json::json!({}), &dir.join("logs"));
    c.worker.program = wrapper(dir).display().to_string();
    c.launcher = launcher;
    c.gpu.mode = mode;
    // A memory estimate makes placement best fit by headroom.
    c.resources.gpu_memory = Some(ByteSize(GIB));
    c.deadlines.startup = Dur(Duration::from_secs(300));
    c.restart.max_restarts = 0;
    if let Some(d) = launcher_dir("torchrun").or_else(|| launcher_dir("mpirun")) {
        let path = std::env::var("PATH").unwrap_or_default();
        c.env
            .set
            .insert("PATH".into(), format!("{}:{path}", d.display()));
    }
    c
}

/// Starts `world` ranks under `launcher`, runs one task, and returns each rank's
/// environment (as many as ranks, each read after the task returned).
fn envs_of(world: u32, launcher: LauncherConfig, mode: GpuMode) -> Vec<BTreeMap<String, String>> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Arc::new(group_config(world, dir.path(), launcher, mode));
    let ledger_dir = dir.path().join("ledger");
    std::fs::create_dir_all(&ledger_dir).unwrap();
    std::fs::set_permissions(&ledger_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let admission = Admission::with_probes(
        cfg.clone(),
        Arc::new(FixedInventory(inventory())),
        Arc::new(SysinfoHost::new()),
        Ledger::at(ledger_dir.join("ledger.json")),
    );
    let exec = MultiProcessExecutor::with_admission(cfg, admission).unwrap();
    let mut ctx = start(&exec);
    exec.run_task("echo", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_or_else(|e| panic!("{world} ranks: {e}"));
    let envs = read_envs(dir.path());
    let pids = exec.live_pids();
    exec.finalize().unwrap();
    assert_gone(&pids, "ranks after finalize");
    assert_eq!(envs.len(), world as usize, "one environment per rank");
    envs
}

fn assert_torchrun_numbering(world: u32, envs: &[BTreeMap<String, String>], what: &str) {
    let mut ranks: Vec<usize> = Vec::new();
    for env in envs {
        let rank = num(env, &["RANKEXEC_RANK", "RANK", "OMPI_COMM_WORLD_RANK"]);
        let local = num(
            env,
            &[
                "RANKEXEC_LOCAL_RANK",
                "LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ],
        );
        ranks.push(rank);
        let visible: Vec<&str> = env["CUDA_VISIBLE_DEVICES"].split(',').collect();
        assert_eq!(
            visible.len(),
            world as usize,
            "{what}, {world} ranks: rank {rank} sees the group's GPUs: {visible:?}"
        );
        assert_eq!(
            visible[local],
            placed(rank),
            "{what}, {world} ranks: rank {rank}'s device LOCAL_RANK={local} of {visible:?} is its placed GPU"
        );
        assert_eq!(
            env.get("CUDA_DEVICE_ORDER").map(String::as_str),
            Some("PCI_BUS_ID")
        );
    }
    ranks.sort_unstable();
    assert_eq!(ranks, (0..world as usize).collect::<Vec<_>>());
}

#[test]
fn builtin_launcher_numbers_gpus_as_torchrun_for_1_to_8_ranks() {
    for world in 1..=8 {
        let envs = envs_of(world, LauncherConfig::Builtin, GpuMode::PerRank);
        assert_torchrun_numbering(world, &envs, "builtin");
        for env in &envs {
            assert_eq!(env.get("LOCAL_RANK"), env.get("RANKEXEC_LOCAL_RANK"));
        }
    }
}

#[test]
fn isolated_mode_gives_each_rank_its_gpu_alone() {
    for world in [1, 3, 8] {
        let envs = envs_of(world, LauncherConfig::Builtin, GpuMode::Isolated);
        for env in &envs {
            let rank = num(env, &["RANKEXEC_RANK"]);
            assert_eq!(env["CUDA_VISIBLE_DEVICES"], placed(rank), "rank {rank}");
        }
    }
}

#[test]
fn isolated_mode_is_refused_with_an_external_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = group_config(
        2,
        dir.path(),
        LauncherConfig::Torchrun { extra_args: vec![] },
        GpuMode::Isolated,
    );
    let err = MultiProcessExecutor::new(cfg).unwrap_err().to_string();
    assert!(
        err.contains("gpu.mode") && err.contains("builtin launcher"),
        "{err}"
    );
}

#[test]
fn torchrun_numbers_gpus_as_torchrun_for_1_to_8_ranks() {
    if launcher_dir("torchrun").is_none() {
        eprintln!("SKIPPED: no torchrun in PATH (torch is absent)");
        return;
    }
    let _serial = serial();
    for world in 1..=8 {
        let envs = envs_of(
            world,
            LauncherConfig::Torchrun { extra_args: vec![] },
            GpuMode::PerRank,
        );
        assert_torchrun_numbering(world, &envs, "torchrun");
    }
}

#[test]
fn mpirun_numbers_gpus_as_torchrun_for_1_to_8_ranks() {
    if launcher_dir("mpirun").is_none() {
        eprintln!("SKIPPED: no mpirun in PATH (Open MPI is absent)");
        return;
    }
    let _serial = serial();
    let mut extra_args = vec!["--oversubscribe".to_owned()];
    if nix::unistd::geteuid().is_root() {
        extra_args.push("--allow-run-as-root".into());
    }
    for world in 1..=8 {
        let envs = envs_of(
            world,
            LauncherConfig::Mpirun {
                extra_args: extra_args.clone(),
            },
            GpuMode::PerRank,
        );
        assert_torchrun_numbering(world, &envs, "mpirun");
    }
}
