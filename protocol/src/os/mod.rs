//! Platform code, behind one module. Only Unix is supported.

#[cfg(unix)]
#[path = "unix.rs"]
mod imp;
mod memory;

pub use imp::ShmError;
pub(crate) use imp::*;
pub(crate) use memory::same_file;
pub use memory::{NoMemory, admit, available_memory, page_align};
