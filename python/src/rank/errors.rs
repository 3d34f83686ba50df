//! The typed exceptions of the rank side (all derive from `rankexec.RankexecError`).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    rankexec,
    RankexecError,
    PyException,
    "Base class of every rankexec error."
);
create_exception!(
    rankexec,
    NotARank,
    RankexecError,
    "This process was not started as a rank (no RANKEXEC_* environment)."
);
create_exception!(
    rankexec,
    TaskAborted,
    RankexecError,
    "Raise it to say a task stopped because its abort signal fired."
);
create_exception!(
    rankexec,
    ReplyError,
    RankexecError,
    "A task was answered twice, or its output cannot be sent."
);
create_exception!(
    rankexec,
    PropConflict,
    RankexecError,
    "A property exists with other flags (private/sticky)."
);
create_exception!(
    rankexec,
    EventFailed,
    RankexecError,
    "An event fired to the host failed or was not answered in time."
);
create_exception!(
    rankexec,
    BufferSealed,
    RankexecError,
    "A shared buffer was already sent and can no longer be written."
);

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RankexecError", py.get_type::<RankexecError>())?;
    m.add("NotARank", py.get_type::<NotARank>())?;
    m.add("TaskAborted", py.get_type::<TaskAborted>())?;
    m.add("ReplyError", py.get_type::<ReplyError>())?;
    m.add("PropConflict", py.get_type::<PropConflict>())?;
    m.add("EventFailed", py.get_type::<EventFailed>())?;
    m.add("BufferSealed", py.get_type::<BufferSealed>())?;
    Ok(())
}
