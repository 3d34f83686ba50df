//! torchrun-compatible `error.json`.
//!
//! When a rank fails hard, it writes the file named by `TORCHELASTIC_ERROR_FILE` (the
//! executor points it at `rank-N/error.json`) in the schema torchrun's `@record` uses:
//!
//! ```json
//! {"message": {"message": "RankError: ...", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
//! ```
//!
//! The executor reads the file into its `RankFailed` error, and an outer torchrun sees
//! the same cause. A rank written in another language can write the same JSON itself.

use std::time::{SystemTime, UNIX_EPOCH};

use rankexec_protocol::env::vars;

/// Writes `error.json` if the variable is set. Failures are logged, never fatal.
pub fn write(kind: &str, message: &str, detail: &str) {
    let Ok(path) = std::env::var(vars::ERROR_FILE) else {
        return;
    };
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let doc = serde_json::json!({
        "message": {
            "message": format!("{kind}: {message}"),
            "extraInfo": {
                "py_callstack": detail,
                "timestamp": timestamp.to_string(),
            }
        }
    });
    if let Err(e) = std::fs::write(&path, doc.to_string()) {
        tracing::warn!(path, error = %e, "cannot write error file");
    }
}
