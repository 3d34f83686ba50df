//! Executor errors as the typed exceptions of `rankexec.host`.
//!
//! The exception classes are defined in Python (`rankexec/host.py`) so that they can be
//! caught, subclassed and documented like any Python class; this module builds them with
//! their attributes: `RankFailed(rank, pid, cause, error_class, stderr_tail, others)`,
//! `Aborted(task, reason, forced)`, `TimedOut(what, timeout_s, pending)`,
//! `StartupFailed(rank, pid, cause, error_class, stderr_tail)`, `EventFailed(event,
//! rank)`, `ConfigError` and the base `RankexecError`. Each message is the whole error
//! chain. A task that was retried (`restart.retry_task`) fails with its last try's
//! exception, which also has `retries` (see `retries_to_py`).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use rankexec_executor::{
    ConfigError, EventError, ExecuteError, FailureCause, RankFailure, StartError, TaskRetry,
};
use rankexec_protocol::error_chain;

/// Builds `rankexec.host.<class>(message, **attrs)`.
fn raise(py: Python<'_>, class: &str, message: String, attrs: Bound<'_, PyDict>) -> PyErr {
    let built = py
        .import("rankexec.host")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call((message.clone(),), Some(&attrs)));
    match built {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

fn failure_attrs<'py>(py: Python<'py>, f: &RankFailure) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rank", f.rank)?;
    d.set_item("pid", f.pid)?;
    d.set_item("cause", f.to_string())?;
    d.set_item("error_class", f.class().as_str())?;
    d.set_item("stderr_tail", f.stderr_tail.clone())?;
    let remote = match &f.cause {
        FailureCause::Reported(e) => Some(e.message.clone()),
        _ => None,
    };
    d.set_item("remote_message", remote)?;
    Ok(d)
}

fn build(
    py: Python<'_>,
    class: &str,
    message: String,
    attrs: PyResult<Bound<'_, PyDict>>,
) -> PyErr {
    match attrs {
        Ok(a) => raise(py, class, message, a),
        Err(e) => e,
    }
}

/// A rank failure at the root of `message`, as `RankFailed`.
fn rank_failed(py: Python<'_>, message: String, f: &RankFailure, others: &[RankFailure]) -> PyErr {
    let attrs = failure_attrs(py, f).and_then(|d| {
        let o: Vec<String> = others.iter().map(|r| r.report()).collect();
        d.set_item("others", o)?;
        // The multi-line report (failure and stderr tail) for logs.
        d.set_item("report", f.report())?;
        Ok(d)
    });
    build(py, "RankFailed", message, attrs)
}

/// The tries a rank's death ended (`restart.retry_task`), as dicts: `attempt`, `rank`,
/// `pid`, `cause` (one line) and `error_class`.
pub(crate) fn retries_to_py<'py>(
    py: Python<'py>,
    retries: &[TaskRetry],
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for r in retries {
        let d = PyDict::new(py);
        d.set_item("attempt", r.attempt)?;
        d.set_item("rank", r.failure.rank)?;
        d.set_item("pid", r.failure.pid)?;
        d.set_item("cause", r.failure.to_string())?;
        d.set_item("error_class", r.failure.class().as_str())?;
        list.append(d)?;
    }
    Ok(list)
}

/// A task's error. One that followed retries is the last try's exception, with the
/// whole chain as its message and the tries as its `retries` attribute.
pub(crate) fn execute_error(py: Python<'_>, e: &ExecuteError) -> PyErr {
    execute_error_with(py, error_chain(e), e)
}

fn execute_error_with(py: Python<'_>, message: String, e: &ExecuteError) -> PyErr {
    match e {
        ExecuteError::Retried { retries, last } => {
            let err = execute_error_with(py, message, last);
            if let Err(set) =
                retries_to_py(py, retries).and_then(|l| err.value(py).setattr("retries", l))
            {
                return set;
            }
            err
        }
        ExecuteError::RankFailed { failure, others } => rank_failed(py, message, failure, others),
        ExecuteError::RestartsExhausted { last, .. } => match last.root_cause() {
            Some(f) => rank_failed(py, message, f, &[]),
            None => build(py, "RankexecError", message, Ok(PyDict::new(py))),
        },
        ExecuteError::Aborted {
            task,
            reason,
            forced,
        } => {
            let d = PyDict::new(py);
            let attrs = d
                .set_item("task", task)
                .and_then(|_| d.set_item("reason", reason))
                .and_then(|_| d.set_item("forced", forced))
                .map(|_| d);
            build(py, "Aborted", message, attrs)
        }
        ExecuteError::Timeout {
            task,
            timeout,
            pending,
        } => {
            let d = PyDict::new(py);
            let attrs = d
                .set_item("what", format!("task `{task}`"))
                .and_then(|_| d.set_item("timeout_s", timeout.as_secs_f64()))
                .and_then(|_| d.set_item("pending", pending.clone()))
                .map(|_| d);
            build(py, "TimedOut", message, attrs)
        }
        ExecuteError::Start(s) => start_error_with(py, message, s),
        ExecuteError::Finalized => {
            let d = PyDict::new(py);
            let attrs = d
                .set_item("task", py.None())
                .and_then(|_| d.set_item("reason", "the group is closed"))
                .and_then(|_| d.set_item("forced", false))
                .map(|_| d);
            build(py, "Aborted", message, attrs)
        }
        ExecuteError::Gather(_) | ExecuteError::Input(_) | ExecuteError::DispatcherGone => {
            build(py, "RankexecError", message, Ok(PyDict::new(py)))
        }
    }
}

/// A start-up error.
pub(crate) fn start_error(py: Python<'_>, e: &StartError) -> PyErr {
    start_error_with(py, error_chain(e), e)
}

fn start_error_with(py: Python<'_>, message: String, e: &StartError) -> PyErr {
    let attrs = (|| {
        let d = PyDict::new(py);
        for k in ["rank", "pid", "cause", "error_class", "remote_message"] {
            d.set_item(k, py.None())?;
        }
        d.set_item("stderr_tail", Vec::<String>::new())?;
        match e {
            StartError::RankFailed(f) => return failure_attrs(py, f),
            StartError::Build { rank, error } => {
                d.set_item("rank", rank)?;
                d.set_item("cause", error.to_string())?;
                d.set_item("error_class", error.0.class.as_str())?;
                d.set_item("remote_message", error.0.message.clone())?;
            }
            StartError::Timeout { .. } => d.set_item("error_class", "timeout")?,
            _ => d.set_item("error_class", "exception")?,
        }
        Ok(d)
    })();
    build(py, "StartupFailed", message, attrs)
}

/// An event's error.
pub(crate) fn event_error(py: Python<'_>, e: &EventError) -> PyErr {
    let message = error_chain(e);
    match e {
        EventError::RankFailed { failure, .. } => rank_failed(py, message, failure, &[]),
        EventError::Timeout {
            event,
            timeout,
            pending,
        } => {
            let d = PyDict::new(py);
            let attrs = d
                .set_item("what", format!("event `{event}`"))
                .and_then(|_| d.set_item("timeout_s", timeout.as_secs_f64()))
                .and_then(|_| d.set_item("pending", pending.clone()))
                .map(|_| d);
            build(py, "TimedOut", message, attrs)
        }
        EventError::Start(s) => start_error_with(py, message, s),
        EventError::Rank { rank, event, .. } => {
            let d = PyDict::new(py);
            let attrs = d
                .set_item("event", event)
                .and_then(|_| d.set_item("rank", rank))
                .map(|_| d);
            build(py, "EventFailed", message, attrs)
        }
        EventError::Encode { event, .. } => {
            let d = PyDict::new(py);
            let attrs = d
                .set_item("event", event)
                .and_then(|_| d.set_item("rank", py.None()))
                .map(|_| d);
            build(py, "EventFailed", message, attrs)
        }
        EventError::Finalized | EventError::DispatcherGone => {
            build(py, "RankexecError", message, Ok(PyDict::new(py)))
        }
    }
}

/// An invalid configuration.
pub(crate) fn config_error(py: Python<'_>, e: &ConfigError) -> PyErr {
    build(py, "ConfigError", error_chain(e), Ok(PyDict::new(py)))
}

/// A configuration that is not valid JSON for the executor.
pub(crate) fn config_text_error(py: Python<'_>, message: String) -> PyErr {
    build(py, "ConfigError", message, Ok(PyDict::new(py)))
}

/// The input could not be copied into shared memory.
pub(crate) fn staging_error(py: Python<'_>, e: &std::io::Error) -> PyErr {
    build(
        py,
        "RankexecError",
        format!("cannot copy the input into shared memory: {e}"),
        Ok(PyDict::new(py)),
    )
}
