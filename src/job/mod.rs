//! Job folders: the configuration a federated job is made of.
//!
//! - [`model`]: the files as typed values.
//! - [`load`](mod@load): loading and validating a folder ([`load::load`](fn@load::load)).

pub mod load;
pub mod model;

pub use load::{ExecutorKind, Job, JobError, LoadedExecutor, load};
