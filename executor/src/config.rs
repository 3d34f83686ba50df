//! `MultiProcessExecutor` configuration: what a job's `executor.args` holds.
//!
//! Everything has a default except `executor_id` and `components`. [`ExecutorConfig::validate`]
//! checks the whole configuration before anything starts and names the offending field
//! with its JSON path.
//!
//! ```
//! use rankexec_executor::ExecutorConfig;
//! let cfg: ExecutorConfig = serde_json::from_value(serde_json::json!({
//!     "executor_id": "echo",
//!     "num_of_processes": 2,
//!     "components": [{"id": "echo", "path": "Echo"}],
//!     "deadlines": {"task": "10s"}
//! })).unwrap();
//! assert_eq!(cfg.num_of_processes, 2);
//! assert!(cfg.validate().is_ok());
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rankexec_protocol::ComponentConfig;
use serde::{Deserialize, Serialize};

use crate::units::{ByteSize, Dur};

/// The largest group this executor will launch.
pub const MAX_PROCESSES: u32 = 1024;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorConfig {
    /// The id, in `components`, of the executor that runs tasks in every rank.
    pub executor_id: String,
    /// How many ranks.
    #[serde(default = "default_processes")]
    pub num_of_processes: u32,
    /// Components every rank builds (the parent builds none of them).
    pub components: Vec<ComponentConfig>,
    /// The rank program.
    #[serde(default)]
    pub worker: WorkerConfig,
    /// Every deadline.
    #[serde(default)]
    pub deadlines: Deadlines,
    /// How ranks are started.
    #[serde(default)]
    pub launcher: LauncherConfig,
    /// How ranks connect back.
    #[serde(default)]
    pub transport: TransportConfig,
    /// Which result a task returns.
    #[serde(default)]
    pub result: ResultPolicy,
    /// When a failed group is relaunched.
    #[serde(default)]
    pub restart: RestartPolicy,
    /// GPU placement.
    #[serde(default)]
    pub gpu: GpuConfig,
    /// Host and GPU memory admission.
    #[serde(default)]
    pub resources: ResourceConfig,
    /// The ranks' environment.
    #[serde(default)]
    pub env: EnvConfig,
    /// Blobs at least this large travel as sealed memory files to local ranks.
    #[serde(default = "default_zero_copy")]
    pub zero_copy_threshold: ByteSize,
    /// The largest frame (header plus inline blobs) accepted from a rank.
    #[serde(default = "default_max_frame")]
    pub max_frame: ByteSize,
    /// Where `rank-N/` log directories go (default: the engine's workspace, then a
    /// temporary directory that is kept).
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    /// Which ranks' events reach the parent's engine.
    #[serde(default)]
    pub relay_events_from: EventRanks,
}

fn default_processes() -> u32 {
    1
}
fn default_zero_copy() -> ByteSize {
    ByteSize(64 << 10)
}
fn default_max_frame() -> ByteSize {
    ByteSize(4 << 30)
}

/// The rank program and its arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// A path (contains `/`) or a name looked up next to the running executable, then in
    /// `PATH`. Default `rankexec-worker`.
    #[serde(default = "default_program")]
    pub program: String,
    /// Arguments.
    #[serde(default)]
    pub args: Vec<String>,
}

fn default_program() -> String {
    "rankexec-worker".to_owned()
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            program: default_program(),
            args: Vec::new(),
        }
    }
}

/// Every wait the executor makes, and its deadline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Deadlines {
    /// Spawn to every rank initialized.
    pub startup: Dur,
    /// One task on every rank.
    pub task: Dur,
    /// One event acknowledged by every rank, or answered by the parent.
    pub event: Dur,
    /// Between heartbeats from each rank.
    pub heartbeat_interval: Dur,
    /// Silence after which a rank is declared unresponsive.
    pub heartbeat_timeout: Dur,
    /// After an abort, how long ranks have to return before the group is killed.
    pub abort_grace: Dur,
    /// After `Close`, how long ranks have to exit before `SIGTERM`.
    pub shutdown_grace: Dur,
    /// After `SIGTERM`, how long before `SIGKILL`.
    pub term_grace: Dur,
    /// How long to wait for host or GPU memory before refusing to start.
    pub admission: Dur,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            startup: Dur(Duration::from_secs(60)),
            task: Dur(Duration::from_secs(3600)),
            event: Dur(Duration::from_secs(30)),
            heartbeat_interval: Dur(Duration::from_secs(1)),
            heartbeat_timeout: Dur(Duration::from_secs(10)),
            abort_grace: Dur(Duration::from_secs(5)),
            shutdown_grace: Dur(Duration::from_secs(5)),
            term_grace: Dur(Duration::from_secs(5)),
            admission: Dur(Duration::from_secs(60)),
        }
    }
}

/// How ranks are started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LauncherConfig {
    /// The executor spawns each rank itself, all in one new process group.
    #[default]
    Builtin,
    /// `torchrun --no-python --nproc-per-node=N ... PROGRAM ARGS`.
    Torchrun {
        /// Extra arguments before the program.
        #[serde(default)]
        extra_args: Vec<String>,
    },
    /// `mpirun -np N ... PROGRAM ARGS` (Open MPI).
    Mpirun {
        /// Extra arguments before the program (e.g. `--oversubscribe`).
        #[serde(default)]
        extra_args: Vec<String>,
    },
    /// `srun --ntasks=N --kill-on-bad-exit=1 ... PROGRAM ARGS` (Slurm).
    Srun {
        /// Extra arguments before the program.
        #[serde(default)]
        extra_args: Vec<String>,
    },
    /// Any command. Placeholders: `{nproc}`, `{master_addr}`, `{master_port}`,
    /// `{program}`, `{log_dir}`, and `{args}` (expands to the worker arguments).
    Command {
        /// The argv template.
        argv: Vec<String>,
        /// Which variables hold each rank's number (`auto` by default).
        #[serde(default)]
        rank_source: Option<String>,
    },
}

/// How ranks reach the parent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum TransportConfig {
    /// A socket file in a private run directory (ranks on this host; zero-copy blobs).
    #[default]
    Local,
    /// TCP, for ranks on other hosts.
    Tcp {
        /// Where to listen; port 0 picks a free port and keeps it bound.
        #[serde(default = "default_bind")]
        bind: String,
        /// The host ranks connect to, if not the bound address (e.g. this node's name).
        #[serde(default)]
        advertise: Option<String>,
    },
}

fn default_bind() -> String {
    "127.0.0.1:0".to_owned()
}

/// Which result a task returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ResultPolicy {
    /// Rank 0's shareable and context (FLARE's rule). Other ranks only report success.
    #[default]
    Rank0,
    /// Every rank returns its shareable; the named blobs (little-endian `f32` arrays) are
    /// averaged, weighted by each rank's numeric meta `weight_key`. The rest comes from
    /// rank 0, and `weight_key` becomes the sum of the weights.
    Gather {
        /// The meta key with each rank's weight (e.g. its sample count).
        weight_key: String,
        /// The blobs to average.
        average: Vec<String>,
        /// The tasks gathered (empty: all); other tasks return rank 0's result.
        #[serde(default)]
        tasks: Vec<String>,
    },
}

/// When a failed group is relaunched.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RestartPolicy {
    /// Relaunches after failures (crash, hang, timeout) before tasks fail for good.
    /// Relaunching after an abort does not count.
    pub max_restarts: u32,
    /// The wait before the first relaunch; it doubles after each further failure.
    pub backoff: Dur,
    /// The longest wait.
    pub max_backoff: Dur,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            backoff: Dur(Duration::from_millis(500)),
            max_backoff: Dur(Duration::from_secs(30)),
        }
    }
}

/// How ranks are placed on GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum GpuMode {
    /// One GPU per rank (`CUDA_VISIBLE_DEVICES` = that GPU's UUID), best fit by free memory.
    #[default]
    PerRank,
    /// Every rank sees every GPU and picks by `LOCAL_RANK`.
    Shared,
    /// Every rank sees the GPUs in `devices`.
    List,
    /// No GPUs: CPU ranks.
    None,
}

/// GPU placement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// The placement mode.
    pub mode: GpuMode,
    /// GPU indices or UUIDs (`list` mode, or to restrict `per_rank`/`shared`).
    pub devices: Vec<String>,
    /// Fail instead of running CPU ranks when there is no GPU.
    pub require_gpu: bool,
}

/// OOM retry budgets per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct OomRetries {
    /// Relaunches when a rank runs out of memory while building its components.
    pub startup: u32,
    /// Re-runs of a task whose rank ran out of memory.
    pub execute: u32,
}

/// Host and GPU memory admission (fedflow's rules, with a reservation ledger).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResourceConfig {
    /// Host memory each rank needs. No estimate: no host memory check.
    pub host_memory: Option<ByteSize>,
    /// GPU memory each rank needs. No estimate: no GPU memory check.
    pub gpu_memory: Option<ByteSize>,
    /// Host memory in use after admission may not exceed this share of the total.
    pub memory_ratio: f64,
    /// Host memory left after admission may not fall below this.
    pub memory_floor: ByteSize,
    /// GPU memory in use after admission may not exceed this share of the total.
    pub gpu_memory_ratio: f64,
    /// GPU memory left after admission may not fall below this.
    pub gpu_memory_floor: ByteSize,
    /// Refuse to start while host CPU utilization is above this share (0..1).
    pub cpu_limit: Option<f64>,
    /// OOM retry budgets.
    pub oom_retries: OomRetries,
    /// Each OOM retry multiplies the estimates by this.
    pub oom_growth: f64,
}

impl Default for ResourceConfig {
    fn default() -> Self {
        ResourceConfig {
            host_memory: None,
            gpu_memory: None,
            memory_ratio: 0.8,
            memory_floor: ByteSize(4 << 30),
            gpu_memory_ratio: 0.8,
            gpu_memory_floor: ByteSize(2 << 30),
            cpu_limit: None,
            oom_retries: OomRetries::default(),
            oom_growth: 1.5,
        }
    }
}

/// The ranks' environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvConfig {
    /// Pass the host's environment on (`false`: only `allow` and `set`).
    pub inherit: bool,
    /// Host variables passed on when `inherit` is false.
    pub allow: Vec<String>,
    /// Variables to set.
    pub set: BTreeMap<String, String>,
}

impl Default for EnvConfig {
    fn default() -> Self {
        EnvConfig {
            inherit: true,
            allow: vec![
                "PATH".into(),
                "HOME".into(),
                "USER".into(),
                "LANG".into(),
                "LD_LIBRARY_PATH".into(),
                "RUST_LOG".into(),
                "RANKEXEC_LOG".into(),
            ],
            set: BTreeMap::new(),
        }
    }
}

/// Which ranks' events reach the parent's engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EventRanks {
    /// Every rank's (handlers see one event per rank, with `FROM_RANK_NUMBER`).
    #[default]
    All,
    /// Rank 0's only; other ranks' events are acknowledged without firing.
    Rank0,
}

/// A configuration error, with the JSON path of the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// Where, e.g. `num_of_processes` or `components[1].id`.
    pub path: String,
    /// What is wrong, and what was expected.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl ResultPolicy {
    /// Whether `task` combines every rank's output.
    pub fn gathers(&self, task: &str) -> bool {
        match self {
            ResultPolicy::Rank0 => false,
            ResultPolicy::Gather { tasks, .. } => {
                tasks.is_empty() || tasks.iter().any(|t| t == task)
            }
        }
    }
}

impl ExecutorConfig {
    /// A minimal configuration: `n` ranks running component `path` as the executor.
    pub fn simple(n: u32, path: &str, args: serde_json::Value) -> Self {
        ExecutorConfig {
            executor_id: "executor".into(),
            num_of_processes: n,
            components: vec![ComponentConfig::new("executor", path, args)],
            worker: WorkerConfig::default(),
            deadlines: Deadlines::default(),
            launcher: LauncherConfig::default(),
            transport: TransportConfig::default(),
            result: ResultPolicy::default(),
            restart: RestartPolicy::default(),
            gpu: GpuConfig::default(),
            resources: ResourceConfig::default(),
            env: EnvConfig::default(),
            zero_copy_threshold: default_zero_copy(),
            max_frame: default_max_frame(),
            log_dir: None,
            relay_events_from: EventRanks::default(),
        }
    }

    /// Checks everything that can be checked without looking at the machine (the worker
    /// program is found by [`resolve_program`] when the executor is created).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_of_processes == 0 || self.num_of_processes > MAX_PROCESSES {
            return Err(ConfigError::new(
                "num_of_processes",
                format!(
                    "must be between 1 and {MAX_PROCESSES}, got {}",
                    self.num_of_processes
                ),
            ));
        }
        if self.components.is_empty() {
            return Err(ConfigError::new(
                "components",
                "must list at least the executor component",
            ));
        }
        let mut ids = BTreeSet::new();
        for (i, c) in self.components.iter().enumerate() {
            if c.id.is_empty() {
                return Err(ConfigError::new(
                    format!("components[{i}].id"),
                    "must not be empty",
                ));
            }
            if !ids.insert(c.id.as_str()) {
                return Err(ConfigError::new(
                    format!("components[{i}].id"),
                    format!("duplicate component id `{}`", c.id),
                ));
            }
            if !(c.args.is_null() || c.args.is_object()) {
                return Err(ConfigError::new(
                    format!("components[{i}].args"),
                    "must be an object",
                ));
            }
        }
        if !ids.contains(self.executor_id.as_str()) {
            return Err(ConfigError::new(
                "executor_id",
                format!(
                    "`{}` is not the id of any component (ids: {})",
                    self.executor_id,
                    ids.into_iter().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        let d = &self.deadlines;
        // Set in code, a `Dur` can exceed what parsing allows; deadlines are added to the
        // current time, so bound them all.
        for (name, v) in [
            ("deadlines.startup", d.startup),
            ("deadlines.task", d.task),
            ("deadlines.event", d.event),
            ("deadlines.heartbeat_interval", d.heartbeat_interval),
            ("deadlines.heartbeat_timeout", d.heartbeat_timeout),
            ("deadlines.abort_grace", d.abort_grace),
            ("deadlines.shutdown_grace", d.shutdown_grace),
            ("deadlines.term_grace", d.term_grace),
            ("deadlines.admission", d.admission),
            ("restart.backoff", self.restart.backoff),
            ("restart.max_backoff", self.restart.max_backoff),
        ] {
            if v > Dur::MAX {
                return Err(ConfigError::new(
                    name,
                    format!("{v} is longer than the 366 days allowed"),
                ));
            }
        }
        for (name, v) in [
            ("startup", d.startup),
            ("task", d.task),
            ("event", d.event),
            ("heartbeat_interval", d.heartbeat_interval),
            ("heartbeat_timeout", d.heartbeat_timeout),
        ] {
            if v.0.is_zero() {
                return Err(ConfigError::new(
                    format!("deadlines.{name}"),
                    "must be greater than zero",
                ));
            }
        }
        if d.heartbeat_timeout.0 <= d.heartbeat_interval.0 * 2 {
            return Err(ConfigError::new(
                "deadlines.heartbeat_timeout",
                format!(
                    "must be more than twice heartbeat_interval ({})",
                    d.heartbeat_interval
                ),
            ));
        }
        if let ResultPolicy::Gather {
            weight_key,
            average,
            ..
        } = &self.result
            && (weight_key.is_empty() || average.is_empty())
        {
            return Err(ConfigError::new(
                "result.gather",
                "needs a weight_key and at least one blob to average",
            ));
        }
        if let LauncherConfig::Command { argv, rank_source } = &self.launcher {
            if argv.is_empty() {
                return Err(ConfigError::new(
                    "launcher.command.argv",
                    "must not be empty",
                ));
            }
            if !argv.iter().any(|a| a.contains("{program}")) {
                return Err(ConfigError::new(
                    "launcher.command.argv",
                    "must contain {program} (where the worker program goes)",
                ));
            }
            if let Some(src) = rank_source
                && src != "auto"
                && src.parse::<rankexec_protocol::env::RankSource>().is_err()
            {
                return Err(ConfigError::new(
                    "launcher.command.rank_source",
                    format!(
                        "`{src}` is not one of auto, rankexec, torchrun, openmpi, pmi, pmix, slurm"
                    ),
                ));
            }
        }
        if self.gpu.mode == GpuMode::List && self.gpu.devices.is_empty() {
            return Err(ConfigError::new(
                "gpu.devices",
                "list mode needs at least one device",
            ));
        }
        let r = &self.resources;
        for (name, v) in [
            ("memory_ratio", r.memory_ratio),
            ("gpu_memory_ratio", r.gpu_memory_ratio),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(ConfigError::new(
                    format!("resources.{name}"),
                    format!("must be in (0, 1], got {v}"),
                ));
            }
        }
        if let Some(c) = r.cpu_limit
            && !(c > 0.0 && c <= 1.0)
        {
            return Err(ConfigError::new(
                "resources.cpu_limit",
                format!("must be in (0, 1], got {c}"),
            ));
        }
        if r.oom_growth < 1.0 {
            return Err(ConfigError::new(
                "resources.oom_growth",
                "must be at least 1.0",
            ));
        }
        if self.max_frame.bytes() < 4096 {
            return Err(ConfigError::new("max_frame", "must be at least 4096 bytes"));
        }
        Ok(())
    }
}

/// Finds the worker program: a path as given, or a name next to the running
/// executable, then in `PATH`.
pub fn resolve_program(program: &str) -> Result<PathBuf, String> {
    if program.is_empty() {
        return Err("must not be empty".into());
    }
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(format!("`{program}` is not an executable file"))
        };
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        // Test binaries live in target/<profile>/deps; the workspace's binaries
        // are one level up.
        let candidates = [
            dir.join(program),
            dir.parent().map(|p| p.join(program)).unwrap_or_default(),
        ];
        for c in candidates {
            if c.as_os_str().is_empty() {
                continue;
            }
            if is_executable(&c) {
                return Ok(c);
            }
            looked.push(c.display().to_string());
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let c = dir.join(program);
            if is_executable(&c) {
                return Ok(c);
            }
        }
        looked.push("PATH".into());
    }
    Err(format!(
        "`{program}` not found (looked in {})",
        looked.join(", ")
    ))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> ExecutorConfig {
        let mut c = ExecutorConfig::simple(2, "Echo", serde_json::Value::Null);
        c.worker.program = "/bin/sh".into();
        c
    }

    #[test]
    fn validation_names_the_field() {
        let mut c = base();
        c.num_of_processes = 0;
        assert_eq!(c.validate().unwrap_err().path, "num_of_processes");
        let mut c = base();
        c.executor_id = "nope".into();
        let e = c.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "executor_id: `nope` is not the id of any component (ids: executor)"
        );
        let mut c = base();
        c.components.push(c.components[0].clone());
        assert_eq!(c.validate().unwrap_err().path, "components[1].id");
        let e = resolve_program("definitely-not-a-program-xyz").unwrap_err();
        assert!(e.contains("not found"), "{e}");
        assert!(resolve_program("/bin/sh").is_ok());
        let mut c = base();
        c.deadlines.heartbeat_timeout = Dur(Duration::from_millis(100));
        assert_eq!(
            c.validate().unwrap_err().path,
            "deadlines.heartbeat_timeout"
        );
        assert!(base().validate().is_ok());
        // Deadlines are added to the current time: a huge one is refused, not a panic.
        let mut c = base();
        c.deadlines.task = Dur(Duration::from_secs(u64::MAX));
        let e = c.validate().unwrap_err();
        assert_eq!(e.path, "deadlines.task");
        let e = serde_json::from_value::<ExecutorConfig>(serde_json::json!({
            "executor_id": "e", "components": [], "deadlines": {"task": 1e12}
        }))
        .unwrap_err();
        assert!(
            e.to_string().contains("longer than the 366 days allowed"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_refused() {
        let e = serde_json::from_value::<ExecutorConfig>(serde_json::json!({
            "executor_id": "e", "components": [], "num_of_procs": 2
        }))
        .unwrap_err();
        assert!(
            e.to_string().contains("unknown field `num_of_procs`"),
            "{e}"
        );
        let e = serde_json::from_value::<ExecutorConfig>(serde_json::json!({
            "executor_id": "e", "components": [], "num_of_processes": "two"
        }))
        .unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
    }

    #[test]
    fn launchers_parse_in_both_forms() {
        let l: LauncherConfig = serde_json::from_str("\"builtin\"").unwrap();
        assert_eq!(l, LauncherConfig::Builtin);
        let l: LauncherConfig =
            serde_json::from_str(r#"{"mpirun": {"extra_args": ["--oversubscribe"]}}"#).unwrap();
        assert!(matches!(l, LauncherConfig::Mpirun { .. }));
    }
}
