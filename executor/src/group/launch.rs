//! Starting a group's processes: the built-in launcher or an external one.
//!
//! **Built-in**: rank 0 is spawned as the leader of a new process group
//! (`process_group(0)`) and ranks 1..N join it, so one `killpg` reaches every rank and
//! anything they start. The ranks are spawned by the executor's dispatcher thread, which
//! lives as long as the executor: `PR_SET_PDEATHSIG` (which the rank requests) fires when
//! the spawning *thread* exits, so spawning from a short-lived thread would kill ranks
//! early.
//!
//! **External** (torchrun, mpirun, srun, any command): one launcher process is spawned
//! as the leader of a new group, from an argv template (no shell, so no quoting bugs).
//! Its ranks are not our children. A rank on a local socket is known by the pid the
//! kernel gives for its connection (`SO_PEERCRED`, see `session::accept`), held by a
//! pidfd, and teardown signals it and its own process group too: torchrun (2.x) starts
//! every worker in a session of its own, so a signal to torchrun's group misses them.
//! Ranks over TCP are never signalled: only `Close` and their launcher end them. The
//! launcher gets `SIGTERM` from the kernel when the dispatcher thread (the executor)
//! dies (`PR_SET_PDEATHSIG`), so a `SIGKILL`ed host takes srun's step, torchrun and
//! mpirun with it at once; the ranks themselves leave by their connections' end of
//! file, whoever launched them.
//!
//! **Tracking from the start**: a pidfd is opened for every process we spawn before its
//! `Child` is dropped. If that fails (out of descriptors), the child is killed and
//! waited for through the `Child` at once, so no process of ours is ever untracked.
//! We refuse to spawn at all while `SIGCHLD` is ignored (or `SA_NOCLDWAIT`): the kernel
//! would reap our children itself, and their pids could be reused while held.
//!
//! Ranks get the environment contract of [`rankexec_protocol::env`], plus a superset of
//! torchrun's variables (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`, `OMP_NUM_THREADS=1`
//! unless set, `CUDA_VISIBLE_DEVICES`, `CUDA_DEVICE_ORDER=PCI_BUS_ID`,
//! `TORCHELASTIC_ERROR_FILE`).

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use rankexec_protocol::env::vars;

use super::output::{Source, Stream};
use super::process::{ProcessTable, Role};
use super::watch::ExitWatcher;
use crate::config::{EnvConfig, LauncherConfig};
use crate::error::StartError;

/// Everything needed to start one group.
pub(crate) struct LaunchPlan {
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<String>,
    pub(crate) world: u32,
    /// Set for every process.
    pub(crate) common: BTreeMap<String, String>,
    /// Set for rank N (built-in launcher only).
    pub(crate) per_rank: Vec<BTreeMap<String, String>>,
    pub(crate) env: EnvConfig,
    pub(crate) launcher: LauncherConfig,
    pub(crate) master_addr: String,
    pub(crate) master_port: u16,
    pub(crate) log_dir: PathBuf,
}

/// What was started.
pub(crate) struct Launched {
    pub(crate) pipes: Vec<(Source, Stream, OwnedFd)>,
    /// The group the built-in launcher made, or the launcher's own.
    pub(crate) pgid: u32,
}

fn spawn_error(what: String, program: &Path, e: std::io::Error) -> StartError {
    StartError::Spawn {
        what,
        program: program.display().to_string(),
        source: Arc::new(e),
    }
}

fn apply_env(cmd: &mut Command, plan: &LaunchPlan, extra: Option<&BTreeMap<String, String>>) {
    if !plan.env.inherit {
        cmd.env_clear();
        for k in &plan.env.allow {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
    }
    // Never pass on our own contract variables if this host is itself a rank (the log
    // filter and the site's declared GPU inventory are not part of the contract: they
    // reach ranks).
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        let site_setting = k == "RANKEXEC_LOG" || k == crate::gpu::INVENTORY_ENV;
        if (k.starts_with("RANKEXEC_") && !site_setting) || k == vars::ERROR_FILE {
            cmd.env_remove(k.as_ref());
        }
    }
    let host_has = |k: &str| plan.env.inherit && std::env::var_os(k).is_some();
    for (k, v) in [
        ("OMP_NUM_THREADS", "1"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
    ] {
        if !host_has(k) && !plan.env.set.contains_key(k) {
            cmd.env(k, v);
        }
    }
    cmd.envs(&plan.env.set);
    cmd.envs(&plan.common);
    if let Some(extra) = extra {
        cmd.envs(extra);
    }
}

fn take_pipes(
    child: &mut std::process::Child,
    src: Source,
    out: &mut Vec<(Source, Stream, OwnedFd)>,
) {
    if let Some(o) = child.stdout.take() {
        out.push((src, Stream::Stdout, OwnedFd::from(o)));
    }
    if let Some(e) = child.stderr.take() {
        out.push((src, Stream::Stderr, OwnedFd::from(e)));
    }
}

/// Tracks a child we just spawned, before its `Child` is dropped. On failure the
/// child is killed and reaped through the `Child` (it is unreaped, so its pid is still
/// its own), so nothing is left running untracked.
fn track(
    table: &ProcessTable,
    watcher: &ExitWatcher,
    role: Role,
    child: &mut std::process::Child,
    pgid: u32,
) -> std::io::Result<()> {
    let pid = child.id();
    let tracked = crate::os::pidfd_open(pid).and_then(|fd| table.add(role, pid, pgid, fd, true));
    match tracked {
        Ok((index, fd)) => {
            watcher.watch(index, fd);
            Ok(())
        }
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

/// Moves the secret from the rank's environment into a pipe the rank inherits (its
/// number in [`vars::SECRET_FD`]): the whole secret is written and the write end
/// closed before the spawn, so the rank reads to end of file. Returns the parent's
/// copy of the read end, to drop once the rank is spawned.
fn secret_pipe(cmd: &mut Command, plan: &LaunchPlan) -> std::io::Result<Option<OwnedFd>> {
    use std::io::Write as _;
    use std::os::fd::{AsFd, AsRawFd};
    let Some(secret) = plan.common.get(vars::SECRET) else {
        return Ok(None);
    };
    cmd.env_remove(vars::SECRET);
    let (reader, mut writer) = std::io::pipe()?;
    writer.write_all(secret.as_bytes())?;
    drop(writer);
    // Above the standard streams, which the spawn replaces; close-on-exec stays set
    // here so no other process spawned meanwhile inherits it.
    let reader = rustix::io::fcntl_dupfd_cloexec(OwnedFd::from(reader).as_fd(), 3)?;
    let raw = reader.as_raw_fd();
    cmd.env(vars::SECRET_FD, raw.to_string());
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed; `fcntl(F_SETFD)` is one (rustix issues the
    // raw syscall, no allocation, no lock). `raw` is the read end duplicated above,
    // open in the parent until this spawn returns (the caller holds it), so it is open
    // in the child too. Tested by `tests/secret_pipe.rs` (the rank reads the secret
    // from it and its environment holds none).
    unsafe {
        cmd.pre_exec(move || {
            let fd = BorrowedFd::borrow_raw(raw);
            rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?;
            Ok(())
        });
    }
    Ok(Some(reader))
}

/// Refuses to spawn while the kernel would reap our children behind our back.
fn check_sigchld(program: &Path) -> Result<(), StartError> {
    match crate::os::sigchld_discards_children() {
        Ok(false) => Ok(()),
        Ok(true) => Err(spawn_error(
            "the rank group".into(),
            program,
            std::io::Error::other(
                "SIGCHLD is ignored in this process (SIG_IGN or SA_NOCLDWAIT), so the kernel \
                 would reap ranks before their exit could be seen; restore its default action",
            ),
        )),
        Err(e) => Err(spawn_error("the rank group".into(), program, e)),
    }
}

/// Starts the processes. Call from the dispatcher thread only (see the module docs).
pub(crate) fn launch(
    plan: &LaunchPlan,
    table: &ProcessTable,
    watcher: &ExitWatcher,
) -> Result<Launched, StartError> {
    check_sigchld(&plan.program)?;
    let mut pipes = Vec::new();
    match &plan.launcher {
        LauncherConfig::Builtin => {
            let mut pgid = 0u32;
            for rank in 0..plan.world {
                let mut cmd = Command::new(&plan.program);
                cmd.args(&plan.args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .process_group(pgid as i32);
                apply_env(&mut cmd, plan, plan.per_rank.get(rank as usize));
                crate::os::reset_signals_on_exec(&mut cmd);
                // Held until the rank is spawned: the parent's copy of the read end closes
                // when this drops, so only the rank holds it.
                let _secret_pipe = secret_pipe(&mut cmd, plan)
                    .map_err(|e| spawn_error(format!("rank {rank}"), &plan.program, e))?;
                let mut own_group = false;
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    // EPERM: the group is gone. Rank 0 is held unreaped once it exits
                    // (its zombie keeps the group), so only a rank 0 reaped behind our
                    // back gets here. Its exit is the failure to report (the watcher
                    // has it); this rank leads a group of its own so it can still be
                    // signalled and reaped.
                    Err(e) if rank > 0 && e.raw_os_error() == Some(libc_eperm()) => {
                        own_group = true;
                        cmd.process_group(0)
                            .spawn()
                            .map_err(|e| spawn_error(format!("rank {rank}"), &plan.program, e))?
                    }
                    Err(e) => return Err(spawn_error(format!("rank {rank}"), &plan.program, e)),
                };
                let pid = child.id();
                if rank == 0 {
                    pgid = pid;
                }
                let rank_pgid = if own_group { pid } else { pgid };
                track(table, watcher, Role::Rank(rank), &mut child, rank_pgid)
                    .map_err(|e| spawn_error(format!("rank {rank}"), &plan.program, e))?;
                take_pipes(&mut child, Source::Rank(rank), &mut pipes);
                // The watcher reaps through the pidfd; std's `Child` neither waits nor
                // kills on drop.
                drop(child);
            }
            Ok(Launched { pipes, pgid })
        }
        other => {
            let argv = expand(other, plan);
            let (prog, rest) = argv.split_first().ok_or_else(|| {
                spawn_error(
                    "the launcher".into(),
                    &plan.program,
                    std::io::Error::other("empty launcher command"),
                )
            })?;
            let mut cmd = Command::new(prog);
            cmd.args(rest)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            apply_env(&mut cmd, plan, None);
            crate::os::reset_signals_on_exec(&mut cmd);
            // The launcher is not a rank: the kernel tells it of our death (SIGTERM), or
            // it would keep its step and its workers' supervision until their exit
            // reached it (the ranks leave by their connections' end of file).
            crate::os::term_with_parent_on_exec(&mut cmd);
            let mut child = cmd
                .spawn()
                .map_err(|e| spawn_error("the launcher".into(), Path::new(prog), e))?;
            let pid = child.id();
            track(table, watcher, Role::Launcher, &mut child, pid)
                .map_err(|e| spawn_error("the launcher".into(), Path::new(prog), e))?;
            take_pipes(&mut child, Source::Launcher, &mut pipes);
            drop(child);
            Ok(Launched { pipes, pgid: pid })
        }
    }
}

fn libc_eperm() -> i32 {
    rustix::io::Errno::PERM.raw_os_error()
}

/// The argv template of a launcher.
pub(crate) fn template(launcher: &LauncherConfig) -> Vec<String> {
    let with = |head: &[&str], extra: &[String], tail: &[&str]| -> Vec<String> {
        head.iter()
            .map(|s| s.to_string())
            .chain(extra.iter().cloned())
            .chain(tail.iter().map(|s| s.to_string()))
            .collect()
    };
    match launcher {
        LauncherConfig::Builtin => vec!["{program}".into(), "{args}".into()],
        LauncherConfig::Torchrun { extra_args } => with(
            &[
                "torchrun",
                "--no-python",
                "--nnodes=1",
                "--nproc-per-node={nproc}",
                "--master-addr={master_addr}",
                "--master-port={master_port}",
                "--log-dir={log_dir}/torchrun",
            ],
            extra_args,
            &["{program}", "{args}"],
        ),
        LauncherConfig::Mpirun { extra_args } => with(
            &["mpirun", "-np", "{nproc}"],
            extra_args,
            &["{program}", "{args}"],
        ),
        LauncherConfig::Srun { extra_args } => with(
            &["srun", "--ntasks={nproc}", "--kill-on-bad-exit=1"],
            extra_args,
            &["{program}", "{args}"],
        ),
        LauncherConfig::Command { argv, .. } => argv.clone(),
    }
}

/// Expands a launcher's template for this plan.
pub(crate) fn expand(launcher: &LauncherConfig, plan: &LaunchPlan) -> Vec<String> {
    let mut out = Vec::new();
    for a in template(launcher) {
        if a == "{args}" {
            out.extend(plan.args.iter().cloned());
            continue;
        }
        out.push(
            a.replace("{nproc}", &plan.world.to_string())
                .replace("{master_addr}", &plan.master_addr)
                .replace("{master_port}", &plan.master_port.to_string())
                .replace("{program}", &plan.program.display().to_string())
                .replace("{log_dir}", &plan.log_dir.display().to_string()),
        );
    }
    out
}

/// The rank-number source an external launcher implies.
pub(crate) fn rank_source(launcher: &LauncherConfig) -> Option<&str> {
    match launcher {
        LauncherConfig::Builtin => Some("rankexec"),
        LauncherConfig::Torchrun { .. } => Some("torchrun"),
        LauncherConfig::Mpirun { .. } => Some("openmpi"),
        LauncherConfig::Srun { .. } => Some("slurm"),
        LauncherConfig::Command { rank_source, .. } => rank_source.as_deref(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(launcher: LauncherConfig) -> LaunchPlan {
        LaunchPlan {
            program: PathBuf::from("/opt/w"),
            args: vec!["worker".into(), "--x".into()],
            world: 4,
            common: BTreeMap::new(),
            per_rank: Vec::new(),
            env: EnvConfig::default(),
            launcher,
            master_addr: "127.0.0.1".into(),
            master_port: 29501,
            log_dir: PathBuf::from("/logs"),
        }
    }

    #[test]
    fn templates_expand_without_a_shell() {
        let p = plan(LauncherConfig::Mpirun {
            extra_args: vec!["--oversubscribe".into()],
        });
        assert_eq!(
            expand(&p.launcher, &p),
            [
                "mpirun",
                "-np",
                "4",
                "--oversubscribe",
                "/opt/w",
                "worker",
                "--x"
            ]
        );
        let p = plan(LauncherConfig::Torchrun { extra_args: vec![] });
        let argv = expand(&p.launcher, &p);
        assert!(argv.contains(&"--nproc-per-node=4".to_string()));
        assert!(argv.contains(&"--master-port=29501".to_string()));
        let p = plan(LauncherConfig::Command {
            argv: vec![
                "env".into(),
                "A=a b#c".into(),
                "{program}".into(),
                "{args}".into(),
            ],
            rank_source: None,
        });
        assert_eq!(
            expand(&p.launcher, &p),
            ["env", "A=a b#c", "/opt/w", "worker", "--x"]
        );
    }
}
