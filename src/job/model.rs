//! The files of a job folder, as typed values.
//!
//! ```text
//! JOB/
//!   meta.json                              name, min_clients, deploy_map
//!   app/config/config_fed_client.json      executors (tasks -> executor), components
//!   app/config/config_fed_server.json      workflows (the controller), components
//! ```
//!
//! The shape follows NVIDIA FLARE's, so a FLARE user recognises it. Every object
//! refuses unknown keys.

use rankexec_executor::Dur;
use rankexec_protocol::ComponentConfig;
use serde::Deserialize;

/// `meta.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// The job's name.
    pub name: String,
    /// How many clients the simulator runs by default.
    #[serde(default)]
    pub min_clients: Option<u32>,
    /// Which app goes to which site (only `app` to `@ALL` is supported).
    #[serde(default)]
    pub deploy_map: Option<serde_json::Value>,
    /// Resource hints (informational).
    #[serde(default)]
    pub resource_spec: Option<serde_json::Value>,
}

/// `config_fed_client.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientAppConfig {
    /// Informational.
    #[serde(default)]
    pub format_version: Option<u32>,
    /// Task routing: each entry runs its tasks on its executor.
    pub executors: Vec<ExecutorEntry>,
    /// Other components (event handlers).
    #[serde(default)]
    pub components: Vec<ComponentConfig>,
}

/// One executor and the tasks it runs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorEntry {
    /// The task names.
    pub tasks: Vec<String>,
    /// The executor: `MultiProcessExecutor` (args: its configuration) or any
    /// registered executor component, run in the client process.
    pub executor: ComponentConfig,
}

/// `config_fed_server.json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerAppConfig {
    /// Informational.
    #[serde(default)]
    pub format_version: Option<u32>,
    /// The controller (exactly one `ScatterAndGather`).
    pub workflows: Vec<ComponentConfig>,
    /// Server components (a `ModelPersistor`).
    #[serde(default)]
    pub components: Vec<ComponentConfig>,
}

/// The args of the `ScatterAndGather` workflow (FedAvg).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScatterAndGatherArgs {
    /// Rounds of training.
    pub num_rounds: u32,
    /// Fewer results than this in a round aborts the job.
    #[serde(default = "two")]
    pub min_clients: u32,
    /// The training task.
    #[serde(default = "train")]
    pub train_task: String,
    /// A task run once on the final model for the final metrics.
    #[serde(default)]
    pub validate_task: Option<String>,
    /// How long a client may take for one training task before it is aborted.
    #[serde(default = "ten_minutes")]
    pub train_timeout: Dur,
    /// The numeric meta key that weights each client's result.
    #[serde(default = "num_samples")]
    pub aggregation_weight: String,
    /// Blobs to average (default: every blob of the first result).
    #[serde(default)]
    pub aggregate: Option<Vec<String>>,
    /// The id of the `ModelPersistor` component.
    #[serde(default)]
    pub persistor_id: Option<String>,
}

fn two() -> u32 {
    2
}
fn train() -> String {
    "train".to_owned()
}
fn num_samples() -> String {
    "num_samples".to_owned()
}
fn ten_minutes() -> Dur {
    Dur(std::time::Duration::from_secs(600))
}

/// The args of the `ModelPersistor` component.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistorArgs {
    /// The file, under the server's workspace directory.
    #[serde(default = "model_file")]
    pub file: String,
}

fn model_file() -> String {
    "global_model.safetensors".to_owned()
}
