//! Finding the worker program.
//!
//! Caveat: the program is resolved once, when the executor is built; replacing the
//! file later changes what the next launch runs.

use std::path::{Path, PathBuf};

/// Finds the worker program: a path as given, or a name next to the running
/// executable, then in `PATH`.
pub fn resolve_program(program: &str) -> Result<PathBuf, String> {
    if program.is_empty() {
        return Err("must not be empty".into());
    }
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(format!("`{program}` is not an executable file"))
        };
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        // Test binaries live in target/<profile>/deps; the workspace's binaries
        // are one level up.
        let candidates = [
            dir.join(program),
            dir.parent().map(|p| p.join(program)).unwrap_or_default(),
        ];
        for c in candidates {
            if c.as_os_str().is_empty() {
                continue;
            }
            if is_executable(&c) {
                return Ok(c);
            }
            looked.push(c.display().to_string());
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let c = dir.join(program);
            if is_executable(&c) {
                return Ok(c);
            }
        }
        looked.push("PATH".into());
    }
    Err(format!(
        "`{program}` not found (looked in {})",
        looked.join(", ")
    ))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
