//! The component registry: builds components from `{id, path, args}` configurations.
//!
//! A configuration names a registered `path` (e.g. `"Echo"`) and gives JSON `args`. Each
//! registration declares a typed argument struct, so a missing argument, a wrong type or
//! an unknown key is a clear error that names the component, and [`Registry::check`]
//! can validate a configuration without constructing anything (the host uses it to
//! validate jobs before any rank starts).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::component::{ComponentError, Executor, FlComponent};

/// A component's configuration: `{"id": ..., "path": ..., "args": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentConfig {
    /// The component's id, unique within its list.
    pub id: String,
    /// The registered path to build it from.
    pub path: String,
    /// The constructor's arguments.
    #[serde(default)]
    pub args: serde_json::Value,
}

impl ComponentConfig {
    /// A configuration with JSON args.
    pub fn new(id: impl Into<String>, path: impl Into<String>, args: serde_json::Value) -> Self {
        ComponentConfig {
            id: id.into(),
            path: path.into(),
            args,
        }
    }
}

/// A built component.
#[derive(Clone)]
pub enum Component {
    /// A component that executes tasks (and handles events).
    Executor(Arc<dyn Executor>),
    /// A component that only handles events.
    Handler(Arc<dyn FlComponent>),
}

impl fmt::Debug for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Component::Executor(_) => f.write_str("Component::Executor"),
            Component::Handler(_) => f.write_str("Component::Handler"),
        }
    }
}

impl Component {
    /// The component as an event handler.
    pub fn handler(&self) -> &dyn FlComponent {
        match self {
            Component::Executor(e) => e.as_ref() as &dyn FlComponent,
            Component::Handler(h) => h.as_ref(),
        }
    }

    /// The component as an executor, if it is one.
    pub fn executor(&self) -> Option<&Arc<dyn Executor>> {
        match self {
            Component::Executor(e) => Some(e),
            Component::Handler(_) => None,
        }
    }
}

/// Why a component could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// No factory is registered under the path.
    #[error("component `{id}`: unknown path `{path}` (known: {known})")]
    UnknownPath {
        /// The component id.
        id: String,
        /// The path asked for.
        path: String,
        /// The registered paths, comma separated.
        known: String,
    },
    /// The arguments do not match the component's argument type.
    #[error("component `{id}` (`{path}`): invalid args")]
    InvalidArgs {
        /// The component id.
        id: String,
        /// The path.
        path: String,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },
    /// The constructor failed.
    #[error("component `{id}` (`{path}`) failed to build")]
    Constructor {
        /// The component id.
        id: String,
        /// The path.
        path: String,
        /// The constructor's error.
        #[source]
        source: ComponentError,
    },
}

type BuildFn = dyn Fn(&serde_json::Value) -> Result<Component, ArgsOrCtor> + Send + Sync;
type CheckFn = dyn Fn(&serde_json::Value) -> Result<(), serde_json::Error> + Send + Sync;

enum ArgsOrCtor {
    Args(serde_json::Error),
    Ctor(ComponentError),
}

struct Entry {
    build: Box<BuildFn>,
    check: Box<CheckFn>,
    kind: &'static str,
}

/// Maps component paths to typed constructors.
///
/// ```
/// use rankexec_protocol::{ComponentConfig, ComponentError, Executor, FlComponent, FlContext, Registry, Shareable, Signal};
///
/// #[derive(serde::Deserialize)]
/// #[serde(deny_unknown_fields)]
/// struct Args { factor: i64 }
/// struct Scale(i64);
/// impl FlComponent for Scale {}
/// impl Executor for Scale {
///     fn execute(&self, _: &str, s: Shareable, _: &mut FlContext, _: &Signal) -> Result<Shareable, ComponentError> {
///         Ok(s.with_meta("factor", self.0))
///     }
/// }
/// let mut reg = Registry::new();
/// reg.executor("Scale", |a: Args| Ok(Scale(a.factor)));
/// let ok = ComponentConfig::new("s", "Scale", serde_json::json!({"factor": 3}));
/// assert!(reg.build(&ok).is_ok());
/// let bad = ComponentConfig::new("s", "Scale", serde_json::json!({"factor": "x"}));
/// assert!(reg.check(&bad).is_err());
/// ```
#[derive(Default)]
pub struct Registry {
    entries: BTreeMap<String, Entry>,
    fallback: Option<Fallback>,
}

type FallbackBuild = dyn Fn(&ComponentConfig) -> Result<Component, ComponentError> + Send + Sync;
type FallbackCheck = dyn Fn(&ComponentConfig) -> Result<(), ComponentError> + Send + Sync;

/// Builds every path no registration claims (a foreign-language loader: Python's
/// `"module:Class"`).
struct Fallback {
    build: Box<FallbackBuild>,
    check: Box<FallbackCheck>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.entries.keys()).finish()
    }
}

/// Treats absent (`null`) args as an empty object, so argument structs with all-default
/// fields accept a config without `args`.
fn normalized(args: &serde_json::Value) -> serde_json::Value {
    if args.is_null() {
        serde_json::Value::Object(Default::default())
    } else {
        args.clone()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers an executor constructor under `path`.
    pub fn executor<A, E, F>(&mut self, path: &str, ctor: F) -> &mut Self
    where
        A: DeserializeOwned + 'static,
        E: Executor,
        F: Fn(A) -> Result<E, ComponentError> + Send + Sync + 'static,
    {
        self.insert::<A, _>(path, "executor", move |args| {
            Ok(Component::Executor(Arc::new(ctor(args)?)))
        })
    }

    /// Registers an event-handler constructor under `path`.
    pub fn handler<A, H, F>(&mut self, path: &str, ctor: F) -> &mut Self
    where
        A: DeserializeOwned + 'static,
        H: FlComponent,
        F: Fn(A) -> Result<H, ComponentError> + Send + Sync + 'static,
    {
        self.insert::<A, _>(path, "handler", move |args| {
            Ok(Component::Handler(Arc::new(ctor(args)?)))
        })
    }

    fn insert<A, F>(&mut self, path: &str, kind: &'static str, ctor: F) -> &mut Self
    where
        A: DeserializeOwned + 'static,
        F: Fn(A) -> Result<Component, ComponentError> + Send + Sync + 'static,
    {
        let build = move |args: &serde_json::Value| {
            let a: A = serde_json::from_value(normalized(args)).map_err(ArgsOrCtor::Args)?;
            ctor(a).map_err(ArgsOrCtor::Ctor)
        };
        let check =
            |args: &serde_json::Value| serde_json::from_value::<A>(normalized(args)).map(drop);
        self.entries.insert(
            path.to_owned(),
            Entry {
                build: Box::new(build),
                check: Box::new(check),
                kind,
            },
        );
        self
    }

    /// Adds every registration of `other` (later ones win, its fallback too).
    pub fn extend(&mut self, other: Registry) -> &mut Self {
        self.entries.extend(other.entries);
        if other.fallback.is_some() {
            self.fallback = other.fallback;
        }
        self
    }

    /// Builds (and checks) every path that no registration claims with `build` (and
    /// `check`), instead of refusing it as unknown. A rank written in another language
    /// uses it to load its own components (Python's `"module:Class"` paths). Errors from
    /// either are [`BuildError::Constructor`].
    ///
    /// ```
    /// use rankexec_protocol::{Component, ComponentConfig, ComponentError, FlComponent, Registry};
    /// struct Loaded;
    /// impl FlComponent for Loaded {}
    /// let mut reg = Registry::new();
    /// reg.fallback(
    ///     |c| if c.path.contains(':') { Ok(Component::Handler(std::sync::Arc::new(Loaded))) }
    ///         else { Err(ComponentError::failed("expected module:Class")) },
    ///     |c| if c.path.contains(':') { Ok(()) } else { Err(ComponentError::failed("expected module:Class")) },
    /// );
    /// assert!(reg.build(&ComponentConfig::new("a", "m:C", serde_json::Value::Null)).is_ok());
    /// assert!(reg.check(&ComponentConfig::new("a", "nope", serde_json::Value::Null)).is_err());
    /// ```
    pub fn fallback<B, C>(&mut self, build: B, check: C) -> &mut Self
    where
        B: Fn(&ComponentConfig) -> Result<Component, ComponentError> + Send + Sync + 'static,
        C: Fn(&ComponentConfig) -> Result<(), ComponentError> + Send + Sync + 'static,
    {
        self.fallback = Some(Fallback {
            build: Box::new(build),
            check: Box::new(check),
        });
        self
    }

    fn ctor_error(cfg: &ComponentConfig, source: ComponentError) -> BuildError {
        BuildError::Constructor {
            id: cfg.id.clone(),
            path: cfg.path.clone(),
            source,
        }
    }

    fn entry(&self, cfg: &ComponentConfig) -> Result<&Entry, BuildError> {
        self.entries
            .get(&cfg.path)
            .ok_or_else(|| BuildError::UnknownPath {
                id: cfg.id.clone(),
                path: cfg.path.clone(),
                known: self.entries.keys().cloned().collect::<Vec<_>>().join(", "),
            })
    }

    /// Builds a component.
    pub fn build(&self, cfg: &ComponentConfig) -> Result<Component, BuildError> {
        if let (false, Some(f)) = (self.entries.contains_key(&cfg.path), &self.fallback) {
            return (f.build)(cfg).map_err(|e| Self::ctor_error(cfg, e));
        }
        (self.entry(cfg)?.build)(&cfg.args).map_err(|e| match e {
            ArgsOrCtor::Args(source) => BuildError::InvalidArgs {
                id: cfg.id.clone(),
                path: cfg.path.clone(),
                source,
            },
            ArgsOrCtor::Ctor(source) => BuildError::Constructor {
                id: cfg.id.clone(),
                path: cfg.path.clone(),
                source,
            },
        })
    }

    /// Validates a configuration (path and argument types) without building it.
    pub fn check(&self, cfg: &ComponentConfig) -> Result<(), BuildError> {
        if let (false, Some(f)) = (self.entries.contains_key(&cfg.path), &self.fallback) {
            return (f.check)(cfg).map_err(|e| Self::ctor_error(cfg, e));
        }
        (self.entry(cfg)?.check)(&cfg.args).map_err(|source| BuildError::InvalidArgs {
            id: cfg.id.clone(),
            path: cfg.path.clone(),
            source,
        })
    }

    /// Whether `path` is registered.
    pub fn contains(&self, path: &str) -> bool {
        self.entries.contains_key(path)
    }

    /// The registered paths with their kind (`"executor"` or `"handler"`).
    pub fn paths(&self) -> impl Iterator<Item = (&str, &'static str)> {
        self.entries.iter().map(|(p, e)| (p.as_str(), e.kind))
    }
}
