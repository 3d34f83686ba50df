//! The server side of a federated job.
//!
//! - [`scatter_gather`]: the FedAvg controller and its reports.
//! - [`persistor`]: the global model on disk (`.safetensors`).

pub mod persistor;
pub mod scatter_gather;

pub use persistor::ModelPersistor;
pub use scatter_gather::{
    ClientState, FedClient, JobStatus, Observer, Outcome, RoundReport, ScatterAndGather, TaskStatus,
};
