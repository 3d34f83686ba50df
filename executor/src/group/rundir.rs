//! The private run directory that holds a group's socket file.
//!
//! It lives under `$XDG_RUNTIME_DIR/rankexec` when that is set (a per-user tmpfs), else
//! under `/tmp/rankexec-<uid>`, because a socket path must fit in 108 bytes and a job
//! workspace path may not. The base directory must be ours and private (0700); the run
//! directory inside it is created 0700 and removed, socket file included, when the
//! group ends.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tempfile::TempDir;

/// A private directory removed on drop.
pub(crate) struct RunDir {
    dir: TempDir,
}

fn base() -> PathBuf {
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR") {
        let p = PathBuf::from(xdg).join("rankexec");
        if p.as_os_str().len() < 60 {
            return p;
        }
    }
    PathBuf::from(format!(
        "/tmp/rankexec-{}",
        rustix::process::geteuid().as_raw()
    ))
}

fn ensure_private(dir: &Path) -> io::Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = fs::symlink_metadata(dir)?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != uid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} is not a directory owned by uid {uid}", dir.display()),
        ));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

impl RunDir {
    /// Creates a fresh private run directory.
    pub(crate) fn create() -> io::Result<RunDir> {
        let base = base();
        ensure_private(&base)?;
        let dir = tempfile::Builder::new().prefix("g").tempdir_in(&base)?;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700))?;
        Ok(RunDir { dir })
    }

    /// The directory.
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Where the group's socket lives.
    pub(crate) fn socket_path(&self) -> PathBuf {
        self.dir.path().join("ctl.sock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_dir_is_private_and_removed() {
        let d = RunDir::create().unwrap();
        let path = d.path().to_owned();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert!(d.socket_path().as_os_str().len() < 100);
        drop(d);
        assert!(!path.exists());
    }
}
