//! Python objects to and from [`Value`]s (task metadata, context properties).
//!
//! Accepted: `None`, `bool`, `int` (64-bit; numpy integers through `__index__`),
//! `float` (and numpy floats), `str`, `bytes`, lists and tuples, and dicts with `str`
//! keys. Anything else is a `TypeError` naming where it was found.

use std::collections::BTreeMap;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple};
use rankexec_protocol::{FlContext, Prop, PropFlags, Value};

/// Converts one object; `at` names it in errors.
pub(crate) fn to_value(obj: &Bound<'_, PyAny>, at: &str) -> PyResult<Value> {
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        return Ok(Value::Map(to_map(d, at)?));
    }
    if obj.cast::<PyList>().is_ok() || obj.cast::<PyTuple>().is_ok() {
        let mut out = Vec::new();
        for (i, item) in obj.try_iter()?.enumerate() {
            out.push(to_value(&item?, &format!("{at}[{i}]"))?);
        }
        return Ok(Value::List(out));
    }
    if obj.hasattr("__index__")? {
        return Ok(Value::Int(obj.extract::<i64>()?));
    }
    if obj.hasattr("__float__")? {
        return Ok(Value::Float(obj.extract::<f64>()?));
    }
    Err(PyTypeError::new_err(format!(
        "{at}: cannot send a {} (use None, bool, int, float, str, bytes, list or dict)",
        obj.get_type().name()?
    )))
}

/// Converts a dict with `str` keys.
pub(crate) fn to_map(d: &Bound<'_, PyDict>, at: &str) -> PyResult<BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    for (k, v) in d.iter() {
        let key: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err(format!("{at}: keys must be str")))?;
        let value = to_value(&v, &format!("{at}[{key:?}]"))?;
        out.insert(key, value);
    }
    Ok(out)
}

/// Converts a value to a Python object.
pub(crate) fn to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => f.into_pyobject(py)?.into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::List(l) => {
            let list = PyList::empty(py);
            for item in l {
                list.append(to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Map(m) => map_to_py(py, m)?.into_any(),
    })
}

/// Converts a map to a dict.
pub(crate) fn map_to_py<'py>(
    py: Python<'py>,
    m: &BTreeMap<String, Value>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in m {
        d.set_item(k, to_py(py, v)?)?;
    }
    Ok(d)
}

/// A context carrying `props` (public, not sticky) on top of `base`.
pub(crate) fn context(base: FlContext, props: Option<&Bound<'_, PyDict>>) -> PyResult<FlContext> {
    let mut ctx = base;
    if let Some(p) = props {
        for (k, v) in to_map(p, "props")? {
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
