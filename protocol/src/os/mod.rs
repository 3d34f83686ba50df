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

/// Whether `addr`'s page is mapped, by `mincore`: a system call only, so safe in a child
/// forked from a multi-threaded test process (the fork tests of `release` and `prefixed`).
#[cfg(all(test, unix))]
pub(crate) fn page_mapped(addr: usize) -> bool {
    let addr = addr - addr % memory::page_size() as usize; // mincore takes a page's start
    let mut v = [0u8; 1];
    // SAFETY: `mincore` only reads the page tables and writes one byte to `v`; an
    // unmapped address is reported as ENOMEM, not touched.
    unsafe { nix::libc::mincore(addr as *mut _, 1, v.as_mut_ptr()) == 0 }
}
