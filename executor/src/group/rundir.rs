//! The private run directory that holds a group's socket file.
//!
//! It lives under `$XDG_RUNTIME_DIR/rankexec` when that is set (a per-user tmpfs), else
//! under `/tmp/rankexec-<uid>`, because a socket path must fit in 108 bytes and a job
//! workspace path may not. The base directory must be ours and private (0700); the run
//! directory inside it is created 0700 and removed, socket file included, when the
//! group ends.
//!
//! A host killed outright (SIGKILL, the OOM killer) cannot remove its own: each run
//! directory is named for its host's pid (`g<pid>-…`), and making a new one removes
//! those whose host no longer exists and whose socket no one listens on (and those named
//! before the pid was in the name, once ten minutes old, whose socket no one listens
//! on). Caveat: a
//! host in another pid namespace sharing the base directory looks dead by its pid; its
//! listening socket keeps its directory (the check connects once, and the group takes
//! that as one silent connection).

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
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

/// The pid a run directory is named for (`g<pid>-<random>`).
fn owner_pid(name: &str) -> Option<u32> {
    let (pid, _) = name.strip_prefix('g')?.split_once('-')?;
    pid.parse().ok()
}

/// Whether no process `pid` exists here (`pidfd_open` fails with `ESRCH`; nothing is
/// signalled). An error of any other kind counts as alive.
fn gone(pid: u32) -> bool {
    match crate::os::pidfd_open(pid) {
        Ok(_) => false,
        Err(e) => e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()),
    }
}

/// Whether a directory was last changed at least [`LEGACY_AGE`] ago.
fn old_enough(entry: &fs::DirEntry) -> bool {
    entry
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age >= LEGACY_AGE)
}

/// How old a run directory named without a pid must be before it may be removed.
const LEGACY_AGE: std::time::Duration = std::time::Duration::from_secs(600);

/// Removes the run directories in `base` of hosts that died without removing theirs
/// (see the module docs). Best effort: what cannot be read, checked or removed is left.
fn sweep_stale(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue; // the GPU ledger and the like live here too
        }
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        match owner_pid(name) {
            Some(pid) if pid == me || !gone(pid) => continue,
            Some(_) => {}
            // Named before run directories carried their pid (`g` and six random
            // characters): only once it is old enough that no host can still be
            // between making it and listening in it.
            None if name.len() == 7 && name.starts_with('g') && old_enough(&entry) => {}
            None => continue,
        }
        let dir = entry.path();
        match UnixStream::connect(dir.join("ctl.sock")) {
            Ok(_) => continue, // a group listens there: not stale
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
                ) => {}
            Err(_) => continue,
        }
        match fs::remove_dir_all(&dir) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), "removed a dead host's run directory")
            }
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "a dead host's run directory stays")
            }
        }
    }
}

impl RunDir {
    /// Creates a fresh private run directory (after removing dead hosts' ones).
    pub(crate) fn create() -> io::Result<RunDir> {
        let base = base();
        ensure_private(&base)?;
        sweep_stale(&base);
        let dir = tempfile::Builder::new()
            .prefix(&format!("g{}-", std::process::id()))
            .tempdir_in(&base)?;
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

    #[test]
    fn a_dead_hosts_run_directory_goes_when_a_group_starts() {
        let base = base();
        ensure_private(&base).unwrap();
        // A directory named for a process that has exited, its socket file left as a
        // SIGKILLed host leaves it (bound, then the listener gone).
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let stale = base.join(format!("g{dead_pid}-stale"));
        fs::create_dir(&stale).unwrap();
        drop(std::os::unix::net::UnixListener::bind(stale.join("ctl.sock")).unwrap());
        // One of a process that has exited whose socket someone still listens on, and
        // one of a live process: both stay.
        let listened = base.join(format!("g{dead_pid}-listened"));
        fs::create_dir(&listened).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(listened.join("ctl.sock")).unwrap();
        let mut live = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let alive = base.join(format!("g{}-alive", live.id()));
        fs::create_dir(&alive).unwrap();
        // Named the old way (`g` and six characters, no pid): removed once ten minutes
        // old, kept while younger.
        let tag = format!("{:05}", std::process::id() % 100_000);
        let (legacy_old, legacy_new) =
            (base.join(format!("gO{tag}")), base.join(format!("gN{tag}")));
        for dir in [&legacy_old, &legacy_new] {
            fs::create_dir(dir).unwrap();
        }
        let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        fs::File::open(&legacy_old)
            .unwrap()
            .set_modified(an_hour_ago)
            .unwrap();

        let d = RunDir::create().unwrap();
        let name = d.path().file_name().unwrap().to_str().unwrap().to_owned();
        assert_eq!(owner_pid(&name), Some(std::process::id()), "{name}");
        assert!(!stale.exists(), "the dead host's directory was removed");
        assert!(listened.exists() && alive.exists());
        assert!(
            !legacy_old.exists() && legacy_new.exists(),
            "by age, without a pid"
        );

        drop(listener);
        live.kill().unwrap(); // our own child, still unreaped: its pid is ours to signal
        live.wait().unwrap();
        for dir in [&listened, &alive, &legacy_new] {
            fs::remove_dir_all(dir).unwrap();
        }
    }
}
