//! Python objects to and from the contract's [`Value`]s (task metadata, context
//! properties, event props), one definition for the rank side and the host side.
//!
//! Values map one to one: `None`, `bool`, `int` (64-bit; numpy integers through
//! `__index__`), `float` (and numpy floats through `__float__`), `str`, `bytes`,
//! `list`/`tuple`, and `dict` with `str` keys. Anything else is a `TypeError` naming
//! where it was found, so nothing is silently dropped or pickled.

use std::collections::BTreeMap;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use rankexec_protocol::Value;

/// A Python object for a value.
pub(crate) fn to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => PyFloat::new(py, *f).into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Map(map) => map_to_py(py, map)?.into_any(),
    })
}

/// A Python dict for a map of values.
pub(crate) fn map_to_py<'py>(
    py: Python<'py>,
    map: &BTreeMap<String, Value>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in map {
        d.set_item(k, to_py(py, v)?)?;
    }
    Ok(d)
}

/// A value from a Python object; `what` names it in errors.
pub(crate) fn from_py(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Value> {
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj
            .extract::<i64>()
            .map(Value::Int)
            .map_err(|_| PyTypeError::new_err(format!("{what}: integer does not fit in 64 bits")));
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
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for (i, item) in obj.try_iter()?.enumerate() {
            items.push(from_py(&item?, &format!("{what}[{i}]"))?);
        }
        return Ok(Value::List(items));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        return map_from_py(d, what).map(Value::Map);
    }
    // numpy scalars and other numbers: accept what converts exactly.
    if let Ok(i) = obj
        .call_method0("__index__")
        .and_then(|i| i.extract::<i64>())
    {
        return Ok(Value::Int(i));
    }
    if let Ok(f) = obj
        .call_method0("__float__")
        .and_then(|f| f.extract::<f64>())
    {
        return Ok(Value::Float(f));
    }
    Err(PyTypeError::new_err(format!(
        "{what}: cannot send a value of type `{}` (use None, bool, int, float, str, bytes, list or dict; \
         large data belongs in a blob)",
        obj.get_type().name()?
    )))
}

/// A map of values from a dict with string keys.
pub(crate) fn map_from_py(d: &Bound<'_, PyDict>, what: &str) -> PyResult<BTreeMap<String, Value>> {
    let mut map = BTreeMap::new();
    for (k, v) in d.iter() {
        let key: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err(format!("{what}: keys must be str")))?;
        let value = from_py(&v, &format!("{what}[{key:?}]"))?;
        map.insert(key, value);
    }
    Ok(map)
}
