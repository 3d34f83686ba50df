//! Checking a configuration before anything starts; every error names its JSON path.

use std::collections::BTreeSet;

use rankexec_protocol::ComponentConfig;

use crate::units::Dur;

use super::schema::*;

/// The smallest `max_rank_log` (a line longer than half of it is cut in the file).
const MIN_RANK_LOG: u64 = 64 << 10;

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
    /// Whether rank `rank` gets the tasks.
    pub fn delivers_to(&self, rank: usize) -> bool {
        rank == 0 || *self != ResultPolicy::Rank0Only
    }

    /// Whether `task` combines every rank's output.
    pub fn gathers(&self, task: &str) -> bool {
        match self {
            ResultPolicy::Rank0 | ResultPolicy::Rank0Only => false,
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
            max_rank_log: default_max_rank_log(),
            relay_events_from: EventRanks::default(),
        }
    }

    /// Checks everything that can be checked without looking at the machine (the worker
    /// program is found by [`resolve_program`](super::resolve_program) when the executor is created).
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
        if self.gpu.mode == GpuMode::Isolated
            && !matches!(self.launcher, super::LauncherConfig::Builtin)
        {
            return Err(ConfigError::new(
                "gpu.mode",
                "isolated needs the builtin launcher: an external launcher starts every rank \
                 with one environment, so each rank sees the group's GPUs and picks by \
                 LOCAL_RANK (per_rank)",
            ));
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
        if self.max_rank_log.bytes() < MIN_RANK_LOG {
            return Err(ConfigError::new("max_rank_log", "must be at least 64 KiB"));
        }
        Ok(())
    }
}
