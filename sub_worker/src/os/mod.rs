//! Platform code, behind one module. Only Unix is supported.

#[cfg(unix)]
#[path = "unix.rs"]
mod imp;

pub(crate) use imp::*;
