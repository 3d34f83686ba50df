//! The engine a Python host gives its rank group: events fired in ranks reach a Python
//! callback `on_event(event, rank, props) -> dict | None`.
//!
//! The callback runs on the executor's relay thread for that rank (one per rank, in
//! order) with the GIL; a dict it returns is merged into the context the rank gets
//! back. An exception in the callback becomes the rank's `fire_event` error. The
//! executor holds the engine weakly: the owning `_HostGroup` keeps it alive.
//!
//! The callback often refers back to the group's owner (a reference cycle); the group
//! shows it to Python's garbage collector and lets it clear it ([`PyEngine::callback`]
//! may be taken away), so a group dropped without `close()` is still torn down.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rankexec_protocol::{Engine, EventType, FireEventError, FlContext, PropFlags, keys};

use super::convert;

/// Calls a Python function for every event a rank fires.
pub(crate) struct PyEngine {
    /// Taken (set to None) when the garbage collector clears the group. Locked only
    /// with the GIL held, briefly (never across a call).
    pub(crate) callback: Mutex<Option<Py<PyAny>>>,
    pub(crate) identity: String,
    pub(crate) job_id: String,
    pub(crate) workspace: PathBuf,
}

impl Engine for PyEngine {
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError> {
        if self
            .callback
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
        {
            return Ok(());
        }
        let rank = ctx
            .get_prop(keys::FROM_RANK_NUMBER)
            .and_then(|v| v.as_i64());
        let remote = |message: String| FireEventError::Remote {
            event: event.as_str().to_owned(),
            message,
        };
        let attached = Python::try_attach(|py| {
            let cb = match &*self.callback.lock().unwrap_or_else(PoisonError::into_inner) {
                Some(cb) => cb.clone_ref(py),
                None => return Ok(()),
            };
            let props = convert::props_to_py(py, ctx.props()).map_err(|e| remote(e.to_string()))?;
            let ret = cb
                .call1(py, (event.as_str(), rank, props))
                .map_err(|e| remote(e.to_string()))?;
            let ret = ret.bind(py);
            if let Ok(d) = ret.cast::<PyDict>() {
                let map = crate::value::map_from_py(d, "the event callback's result")
                    .map_err(|e| remote(e.to_string()))?;
                for (k, v) in map {
                    if let Err(c) = ctx.set_prop(k, v, PropFlags::PUBLIC) {
                        tracing::warn!(event = %event, "{c}");
                    }
                }
            }
            Ok(())
        });
        attached.unwrap_or_else(|| Err(remote("the Python interpreter is shutting down".into())))
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn job_id(&self) -> &str {
        &self.job_id
    }

    fn workspace(&self) -> &Path {
        &self.workspace
    }
}
