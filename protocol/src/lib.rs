//! The rankexec contract and wire protocol.
//!
//! This crate is what a host, an executor and a rank agree on, and it depends on no
//! other rankexec crate:
//!
//! - the **component contract**: [`Shareable`], [`FlContext`], [`Signal`],
//!   [`EventType`], the [`Executor`] and [`FlComponent`] traits, the [`Engine`] that
//!   components fire events into, and the [`Registry`] that builds components from
//!   `{id, path, args}`;
//! - the **wire**: [`wire`] (messages, framing, handshake, transports) and [`env`](mod@env) (the
//!   environment a rank starts with).

pub mod component;
pub mod context;
pub mod env;
pub mod event;
#[doc(hidden)]
pub mod fuzzing;
mod os;
pub mod registry;
pub mod shareable;
pub mod signal;
pub mod value;
pub mod wire;

pub use component::{
    ComponentError, Engine, ErrorClass, Executor, FireEventError, FlComponent, error_chain,
    panic_message,
};
pub use context::{FlContext, Prop, PropConflict, PropFlags, keys};
pub use event::EventType;
pub use os::{
    HugeAllocator, NoMemory, PrefixError, PrefixedMap, ShmError, ShmemHugePages,
    admit as admit_shared_memory, advise_huge, available_memory, mapping_bytes, page_align,
};
pub use registry::{BuildError, Component, ComponentConfig, Registry};
pub use shareable::{Blob, Shareable};
pub use signal::{Signal, Subscription};
pub use value::Value;
