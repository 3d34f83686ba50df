//! Platform code, behind one module. Only Unix is supported.

mod huge;
#[cfg(unix)]
#[path = "unix.rs"]
mod imp;
mod memory;
#[cfg(unix)]
mod prefixed;
#[cfg(unix)]
mod release;

pub use huge::{HugeAllocator, ShmemHugePages, advise_huge};
pub use imp::ShmError;
pub(crate) use imp::*;
pub(crate) use memory::same_file;
pub use memory::{NoMemory, admit, available_memory, page_align};
#[cfg(unix)]
pub use prefixed::{PrefixError, PrefixedMap};
#[cfg(unix)]
pub use release::mapping_bytes;
