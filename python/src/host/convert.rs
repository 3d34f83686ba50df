//! Contexts and their properties for the host side; values themselves are converted
//! by `crate::value`.

use std::collections::BTreeMap;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rankexec_protocol::{FlContext, Prop, PropFlags};

use crate::value::{map_from_py, to_py};

/// A context carrying `props` (public, not sticky) on top of `base`.
pub(crate) fn context(base: FlContext, props: Option<&Bound<'_, PyDict>>) -> PyResult<FlContext> {
    let mut ctx = base;
    if let Some(p) = props {
        for (k, v) in map_from_py(p, "props")? {
            ctx.set_prop(k, v, PropFlags::PUBLIC)
                .map_err(|e| PyTypeError::new_err(e.to_string()))?;
        }
    }
    Ok(ctx)
}

/// A context's properties as a dict (values only).
pub(crate) fn props_to_py<'py>(
    py: Python<'py>,
    props: &BTreeMap<String, Prop>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, p) in props {
        d.set_item(k, to_py(py, &p.value)?)?;
    }
    Ok(d)
}
