//! The client side of a federated job.
//!
//! - [`engine`]: the site's engine (events, sticky properties).
//! - [`client`]: the client runtime (task routing, lifecycle events, aborts).
//! - [`gate`]: the cap on rank groups alive at once.

pub mod client;
pub mod engine;
pub mod gate;

pub use client::{ClientError, ClientRuntime};
pub use engine::ClientEngine;
pub use gate::{GroupGate, Slot};
