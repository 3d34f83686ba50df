//! The configuration's shape: every field of `executor.args`, its serde form and its
//! default.

use std::collections::BTreeMap;
use std::path::PathBuf;
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
    /// The most bytes of each rank's stdout, and of its stderr, kept on disk while the
    /// group lives (an external launcher's too): `stdout.log` becomes `stdout.log.1`
    /// (replacing the older one) before a line takes it past half of this, so the last
    /// half to all of it is kept. At least 64 KiB. Count it for every rank and stream
    /// where `log_dir` is memory (`$XDG_RUNTIME_DIR`, `/dev/shm`).
    #[serde(default = "default_max_rank_log")]
    pub max_rank_log: ByteSize,
    /// Which ranks' events reach the parent's engine.
    #[serde(default)]
    pub relay_events_from: EventRanks,
}

fn default_processes() -> u32 {
    1
}
pub(super) fn default_zero_copy() -> ByteSize {
    ByteSize(64 << 10)
}
pub(super) fn default_max_frame() -> ByteSize {
    ByteSize(4 << 30)
}
pub(super) fn default_max_rank_log() -> ByteSize {
    ByteSize(64 << 20)
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
    /// Only rank 0 gets the tasks; its shareable and context are the result. The other
    /// ranks never see a task (nor its abort): they follow rank 0 on their own, through
    /// collectives, as the ranks other than 0 of a FLARE Client API script do. Their
    /// crash, hang or exit still fails the task in flight and the group.
    Rank0Only,
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
    /// Re-runs of a task whose rank died from outside (a signal, the OOM killer, a lost
    /// node or link; never an exception, exit code or fault of the rank's own code), on a
    /// relaunched group and within the task's deadline, before the task fails. Each is a
    /// relaunch (it counts against `max_restarts`). 0: off.
    pub retry_task: u32,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            backoff: Dur(Duration::from_millis(500)),
            max_backoff: Dur(Duration::from_secs(30)),
            retry_task: 0,
        }
    }
}

/// How ranks are placed on GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum GpuMode {
    /// One GPU per rank, best fit by free memory, with torchrun's numbering: every
    /// rank sees the group's GPUs (`CUDA_VISIBLE_DEVICES` = their UUIDs in rank order),
    /// so device index `LOCAL_RANK` is the GPU placed for that rank and
    /// `torch.cuda.set_device(LOCAL_RANK)` works unchanged.
    #[default]
    PerRank,
    /// One GPU per rank, placed as `per_rank`, but each rank sees only its own
    /// (`CUDA_VISIBLE_DEVICES` = that GPU's UUID): every rank's device is `cuda:0`, and
    /// `set_device(LOCAL_RANK)` fails on every rank but 0. Builtin launcher only.
    Isolated,
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
    /// GPU indices or UUIDs (`list` mode, or to restrict `per_rank`/`isolated`/`shared`).
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
