//! Python objects to and from the contract's [`Value`]s (task metadata, context
//! properties, event props), one definition for the rank side and the host side.
//!
//! Values map one to one: `None`, `bool`, `int` (64-bit; numpy integers through
//! `__index__`), `float` (and numpy floats through `__float__`), `str`, `bytes`,
//! `list`/`tuple`, and `dict` with `str` keys. Anything else is a `TypeError` naming
//! where it was found, so nothing is silently dropped or pickled.
//!
//! Conversion is bounded: a list or dict that contains itself, or lists and dicts
//! nested deeper than the receiver decodes (`MAX_DEPTH`, 64), raise `ValueBoundsError`
//! naming the path (`meta.a[0].b: nested deeper than 64`, `meta.x: refers to itself`)
//! instead of recursing until the stack overflows.

use std::collections::BTreeMap;

use pyo3::create_exception;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use rankexec_protocol::Value;
use rankexec_protocol::value::MAX_DEPTH;

use crate::rank::errors::RankexecError;

create_exception!(
    rankexec,
    ValueBoundsError,
    RankexecError,
    "A value cannot be sent: a list or dict contains itself, or they nest deeper than 64."
);

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

/// One step of the path to a value, for errors.
enum Step {
    Key(String),
    Index(usize),
}

/// Where the conversion is: the path from the root and the containers open on it.
struct Walk<'a> {
    root: &'a str,
    steps: Vec<Step>,
    /// The lists, tuples and dicts being converted, outermost first (by address): one
    /// met again inside itself is a cycle.
    open: Vec<usize>,
    /// How many of `open` are not levels of a value (the dict of a map's root).
    roots: usize,
}

impl Walk<'_> {
    fn path(&self) -> String {
        let mut p = self.root.to_owned();
        for s in &self.steps {
            match s {
                Step::Key(k) => {
                    p.push('.');
                    p.push_str(k);
                }
                Step::Index(i) => {
                    p.push('[');
                    p.push_str(&i.to_string());
                    p.push(']');
                }
            }
        }
        p
    }

    /// Enters a container: refuses one already open (a cycle) or one level too many.
    fn enter(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        let addr = obj.as_ptr() as usize;
        if self.open.contains(&addr) {
            return Err(ValueBoundsError::new_err(format!(
                "{}: refers to itself",
                self.path()
            )));
        }
        if self.open.len() - self.roots >= MAX_DEPTH as usize {
            return Err(ValueBoundsError::new_err(format!(
                "{}: nested deeper than {MAX_DEPTH}",
                self.path()
            )));
        }
        self.open.push(addr);
        Ok(())
    }

    fn leave(&mut self) {
        self.open.pop();
    }

    /// Converts `obj` with `step` appended to the path.
    fn child(&mut self, step: Step, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
        self.steps.push(step);
        let v = self.value(obj);
        self.steps.pop();
        v
    }

    fn value(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
        if obj.is_none() {
            return Ok(Value::Null);
        }
        if let Ok(b) = obj.cast::<PyBool>() {
            return Ok(Value::Bool(b.is_true()));
        }
        if obj.is_instance_of::<PyInt>() {
            return obj.extract::<i64>().map(Value::Int).map_err(|_| {
                PyTypeError::new_err(format!("{}: integer does not fit in 64 bits", self.path()))
            });
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
            self.enter(obj)?;
            let items = self.items(obj);
            self.leave();
            return items.map(Value::List);
        }
        if let Ok(d) = obj.cast::<PyDict>() {
            self.enter(obj)?;
            let map = self.map(d);
            self.leave();
            return map.map(Value::Map);
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
            "{}: cannot send a value of type `{}` (use None, bool, int, float, str, bytes, list or \
             dict; large data belongs in a blob)",
            self.path(),
            obj.get_type().name()?
        )))
    }

    fn items(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Value>> {
        let mut items = Vec::new();
        for (i, item) in obj.try_iter()?.enumerate() {
            items.push(self.child(Step::Index(i), &item?)?);
        }
        Ok(items)
    }

    fn map(&mut self, d: &Bound<'_, PyDict>) -> PyResult<BTreeMap<String, Value>> {
        let mut map = BTreeMap::new();
        for (k, v) in d.iter() {
            let key: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("{}: keys must be str", self.path())))?;
            let value = self.child(Step::Key(key.clone()), &v)?;
            map.insert(key, value);
        }
        Ok(map)
    }
}

/// A value from a Python object; `what` names it in errors (`what.key[0]`). A list or
/// dict that contains itself, or lists and dicts nested deeper than [`MAX_DEPTH`] (what
/// the receiver decodes), raise `ValueBoundsError`.
pub(crate) fn from_py(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Value> {
    Walk {
        root: what,
        steps: Vec::new(),
        open: Vec::new(),
        roots: 0,
    }
    .value(obj)
}

/// A map of values from a dict with string keys (the dict itself is not a level: its
/// values are checked as `what.key`).
pub(crate) fn map_from_py(d: &Bound<'_, PyDict>, what: &str) -> PyResult<BTreeMap<String, Value>> {
    Walk {
        root: what,
        steps: Vec::new(),
        open: vec![d.as_ptr() as usize],
        roots: 1,
    }
    .map(d)
}

/// Adds `ValueBoundsError` to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ValueBoundsError", m.py().get_type::<ValueBoundsError>())
}
