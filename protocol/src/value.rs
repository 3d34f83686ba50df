//! A self-contained value type for metadata and context properties.
//!
//! The wire codec (bincode) is not self-describing, so `serde_json::Value` cannot cross
//! the wire. [`Value`] is a small tagged enum that can, and that converts to and from
//! JSON for configuration and reports.
//!
//! Decoding is bounded: nested lists and maps deeper than [`MAX_DEPTH`] are refused
//! with an error instead of overflowing the stack, so a malformed frame from a peer
//! cannot crash the process. The sender checks the same bound first
//! ([`Value::check_bounds`], [`check_map`]): a value the peer would refuse is refused
//! where it is made, with its path, instead of breaking the connection.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

/// The deepest nesting of [`Value::List`] and [`Value::Map`] that decoding accepts.
pub const MAX_DEPTH: u32 = 64;

/// A dynamically typed value carried in [`Shareable`](crate::Shareable) metadata and
/// [`FlContext`](crate::FlContext) properties.
///
/// ```
/// use rankexec_protocol::Value;
/// let v = Value::from(3_i64);
/// assert_eq!(v.as_i64(), Some(3));
/// assert_eq!(Value::from("x").as_str(), Some("x"));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub enum Value {
    /// No value.
    #[default]
    Null,
    /// A boolean.
    Bool(bool),
    /// A signed integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// A small byte string (large data belongs in a blob).
    Bytes(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A list of values.
    List(#[serde(deserialize_with = "guarded")] Vec<Value>),
    /// A string-keyed map of values.
    Map(#[serde(deserialize_with = "guarded")] BTreeMap<String, Value>),
}

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Counts nesting while a list or map is being decoded.
struct DepthGuard;

impl DepthGuard {
    fn enter() -> Result<Self, String> {
        DEPTH.with(|d| {
            let next = d.get() + 1;
            if next > MAX_DEPTH {
                Err(format!("value nested deeper than {MAX_DEPTH} levels"))
            } else {
                d.set(next);
                Ok(DepthGuard)
            }
        })
    }
}

impl Drop for DepthGuard {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

fn guarded<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let _guard = DepthGuard::enter().map_err(serde::de::Error::custom)?;
    T::deserialize(deserializer)
}

/// Why a value cannot be sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    /// Lists and maps nest deeper than [`MAX_DEPTH`] at `path`.
    #[error("{path}: nested deeper than {max}")]
    TooDeep {
        /// Where, e.g. `meta.a[0].b`.
        path: String,
        /// The limit.
        max: u32,
    },
}

/// One step of a path into a value.
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// The steps (innermost first) to the first list or map below `v` that would sit
/// deeper than [`MAX_DEPTH`], if any; `depth` is how many enclose `v`. The recursion
/// stops at the limit, so it is bounded however deep the value is.
fn too_deep(v: &Value, depth: u32) -> Option<Vec<Step<'_>>> {
    let inner = depth + 1;
    match v {
        Value::List(_) | Value::Map(_) if inner > MAX_DEPTH => Some(Vec::new()),
        Value::List(items) => items.iter().enumerate().find_map(|(i, item)| {
            too_deep(item, inner).map(|mut p| {
                p.push(Step::Index(i));
                p
            })
        }),
        Value::Map(map) => map.iter().find_map(|(k, item)| {
            too_deep(item, inner).map(|mut p| {
                p.push(Step::Key(k));
                p
            })
        }),
        _ => None,
    }
}

fn path_of(root: &str, steps: Vec<Step<'_>>) -> String {
    let mut path = root.to_owned();
    for step in steps.into_iter().rev() {
        match step {
            Step::Key(k) => {
                path.push('.');
                path.push_str(k);
            }
            Step::Index(i) => {
                path.push('[');
                path.push_str(&i.to_string());
                path.push(']');
            }
        }
    }
    path
}

/// Checks every value of `map` (named `root.KEY` in errors), as
/// [`Value::check_bounds`] does.
///
/// ```
/// use std::collections::BTreeMap;
/// use rankexec_protocol::value::{check_map, Value};
/// let mut v = Value::Null;
/// for _ in 0..65 {
///     v = Value::List(vec![v]);
/// }
/// let meta = BTreeMap::from([("a".to_owned(), v)]);
/// let err = check_map("meta", &meta).unwrap_err();
/// assert!(err.to_string().starts_with("meta.a[0]"), "{err}");
/// ```
pub fn check_map<'a>(
    root: &str,
    map: impl IntoIterator<Item = (&'a String, &'a Value)>,
) -> Result<(), ValueError> {
    for (k, v) in map {
        if let Some(steps) = too_deep(v, 0) {
            return Err(ValueError::TooDeep {
                path: path_of(&format!("{root}.{k}"), steps),
                max: MAX_DEPTH,
            });
        }
    }
    Ok(())
}

impl Value {
    /// Checks that the peer will accept this value: lists and maps nest at most
    /// [`MAX_DEPTH`] deep. `path` names the value in the error.
    pub fn check_bounds(&self, path: &str) -> Result<(), ValueError> {
        match too_deep(self, 0) {
            Some(steps) => Err(ValueError::TooDeep {
                path: path_of(path, steps),
                max: MAX_DEPTH,
            }),
            None => Ok(()),
        }
    }

    /// The integer, if this is [`Value::Int`].
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// The number as `f64`, if this is [`Value::Int`] or [`Value::Float`].
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(v) => Some(*v as f64),
            Value::Float(v) => Some(*v),
            _ => None,
        }
    }

    /// The string, if this is [`Value::Str`].
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The boolean, if this is [`Value::Bool`].
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The map, if this is [`Value::Map`].
    pub fn as_map(&self) -> Option<&BTreeMap<String, Value>> {
        match self {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    /// Converts to JSON. Bytes become an array of numbers; non-finite floats become null.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Null => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            Value::Str(s) => J::String(s.clone()),
            Value::Bytes(b) => J::Array(b.iter().map(|x| J::from(*x)).collect()),
            Value::List(l) => J::Array(l.iter().map(Value::to_json).collect()),
            Value::Map(m) => J::Object(m.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()),
        }
    }

    /// Converts from JSON. Integers that do not fit `i64` become floats.
    pub fn from_json(json: &serde_json::Value) -> Value {
        use serde_json::Value as J;
        match json {
            J::Null => Value::Null,
            J::Bool(b) => Value::Bool(*b),
            J::Number(n) => match n.as_i64() {
                Some(i) => Value::Int(i),
                None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            J::String(s) => Value::Str(s.clone()),
            J::Array(a) => Value::List(a.iter().map(Value::from_json).collect()),
            J::Object(o) => Value::Map(
                o.iter()
                    .map(|(k, v)| (k.clone(), Value::from_json(v)))
                    .collect(),
            ),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_json())
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Value::Int(v.into())
    }
}
impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::Int(v.into())
    }
}
impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}
impl From<f32> for Value {
    fn from(v: f32) -> Self {
        Value::Float(v.into())
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.to_owned())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Str(v)
    }
}
impl From<Vec<Value>> for Value {
    fn from(v: Vec<Value>) -> Self {
        Value::List(v)
    }
}
impl From<BTreeMap<String, Value>> for Value {
    fn from(v: BTreeMap<String, Value>) -> Self {
        Value::Map(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::codec;

    #[test]
    fn json_round_trip_keeps_structure() {
        let json = serde_json::json!({"a": [1, 2.5, "x", null, true], "b": {"c": -4}});
        let value = Value::from_json(&json);
        assert_eq!(value.to_json(), json);
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let mut v = Value::Null;
        for _ in 0..(MAX_DEPTH + 5) {
            v = Value::List(vec![v]);
        }
        let bytes = codec::encode(&v).expect("encode");
        let err = codec::decode::<Value>(&bytes).expect_err("nesting beyond the limit must fail");
        let cause = std::error::Error::source(&err)
            .map(ToString::to_string)
            .unwrap_or_default();
        assert!(cause.contains("nested deeper"), "{err}: {cause}");
        // The guard resets, so a shallow value decodes afterwards on the same thread.
        let ok = codec::encode(&Value::List(vec![Value::Int(1)])).expect("encode");
        assert!(codec::decode::<Value>(&ok).is_ok());
    }

    fn nested(levels: u32) -> Value {
        let mut v = Value::Int(1);
        for i in 0..levels {
            v = if i % 2 == 0 {
                Value::List(vec![Value::Null, v])
            } else {
                Value::Map(BTreeMap::from([("k".to_owned(), v)]))
            };
        }
        v
    }

    #[test]
    fn the_sender_checks_the_bound_the_receiver_enforces() {
        // Exactly the limit: accepted by the check and by the decoder.
        let ok = nested(MAX_DEPTH);
        ok.check_bounds("v").expect("the limit itself is fine");
        let bytes = codec::encode(&ok).expect("encode");
        assert!(codec::decode::<Value>(&bytes).is_ok());
        // One more: refused by both, the check naming the path.
        let deep = nested(MAX_DEPTH + 1);
        let err = deep.check_bounds("meta.x").unwrap_err();
        let ValueError::TooDeep { path, max } = &err;
        assert_eq!(*max, MAX_DEPTH);
        assert!(path.starts_with("meta.x[1].k[1].k[1]"), "{path}");
        assert!(
            err.to_string().ends_with(": nested deeper than 64"),
            "{err}"
        );
        let bytes = codec::encode(&deep).expect("encode");
        assert!(codec::decode::<Value>(&bytes).is_err());
    }

    #[test]
    fn a_very_deep_value_is_checked_without_overflowing() {
        // Far deeper than any stack would survive when recursing to the bottom.
        let mut v = Value::Null;
        for _ in 0..1_000_000 {
            v = Value::List(vec![v]);
        }
        assert!(v.check_bounds("v").is_err());
        // Dropping it recursively would overflow: take it apart iteratively.
        while let Value::List(mut items) = v {
            v = items.pop().unwrap_or(Value::Null);
        }
    }
}
