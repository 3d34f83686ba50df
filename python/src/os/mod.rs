//! Platform code, behind one module. Only Linux is supported (memory files).

#[cfg(unix)]
#[path = "unix.rs"]
mod imp;

pub(crate) use imp::*;
