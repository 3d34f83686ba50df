//! `FlContext`: the properties that travel with a task or an event within one site.
//!
//! Every property carries two flags, as in FLARE:
//! - **private**: the property stays on this site. It reaches this site's ranks, but
//!   [`FlContext::peer_props`] (what a client shares with the server) leaves it out.
//! - **sticky**: the property outlives the context it was set in. The host copies sticky
//!   properties into every context it creates later (see [`FlContext::sticky_props`]).
//!
//! # Merge rule
//!
//! When a context comes back from somewhere else (rank 0 after a task, a rank after an
//! event, the parent after relaying a rank's event), [`FlContext::merge_from`] applies
//! it property by property:
//! 1. a key absent here is added, with the incoming value and flags;
//! 2. a key present with the same flags takes the incoming value;
//! 3. a key present with different flags is a **conflict**: the local property is kept
//!    and the conflict is returned to the caller (FLARE's `props.update` silently
//!    bypassed its own mask check; we do not);
//! 4. keys missing from the incoming set are kept: a merge never deletes.
//!
//! The engine handle attached to a context is never merged or serialized.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::component::Engine;
use crate::value::Value;

/// Well-known property keys.
pub mod keys {
    /// The local rank of the process a context lives in (set in ranks, private, sticky).
    pub const RANK_NUMBER: &str = "__rank_number__";
    /// The number of ranks in the group (set in ranks, private, sticky).
    pub const NUM_OF_PROCESSES: &str = "__num_of_processes__";
    /// The rank an event was relayed from (set in the parent, private, not sticky).
    pub const FROM_RANK_NUMBER: &str = "__from_rank_number__";
    /// Where an event came from: `"rank"` for events relayed up from a rank.
    pub const EVENT_ORIGIN_SITE: &str = "__event_origin_site__";
    /// The task being executed.
    pub const TASK_NAME: &str = "__task_name__";
    /// The task's unique id.
    pub const TASK_ID: &str = "__task_id__";
    /// The site (client) name.
    pub const IDENTITY_NAME: &str = "__identity_name__";
    /// The job id.
    pub const JOB_ID: &str = "__job_id__";
    /// The current federated round.
    pub const CURRENT_ROUND: &str = "__current_round__";
    /// The site's 0-based index among the job's sites (set by the client runtime).
    pub const SITE_INDEX: &str = "__site_index__";
    /// How many sites (clients) the job has (set by the client runtime).
    pub const NUM_SITES: &str = "__num_sites__";
}

/// A property value with its flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prop {
    /// The value.
    pub value: Value,
    /// Stays on this site (not shared with peers).
    pub private: bool,
    /// Carried into later contexts.
    pub sticky: bool,
}

/// The flags of a property. `PropFlags::default()` is public and not sticky.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PropFlags {
    /// Stays on this site.
    pub private: bool,
    /// Carried into later contexts.
    pub sticky: bool,
}

impl PropFlags {
    /// Public, not sticky.
    pub const PUBLIC: PropFlags = PropFlags {
        private: false,
        sticky: false,
    };
    /// Private, not sticky.
    pub const PRIVATE: PropFlags = PropFlags {
        private: true,
        sticky: false,
    };
    /// Private and sticky.
    pub const PRIVATE_STICKY: PropFlags = PropFlags {
        private: true,
        sticky: true,
    };
    /// Public and sticky.
    pub const STICKY: PropFlags = PropFlags {
        private: false,
        sticky: true,
    };
}

/// A property whose flags differ from the incoming ones; see the merge rule.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "property `{key}` is {existing} here and cannot become {incoming}",
    existing = flags_text(self.existing),
    incoming = flags_text(self.incoming)
)]
pub struct PropConflict {
    /// The key.
    pub key: String,
    /// The flags it has here.
    pub existing: PropFlags,
    /// The flags it was offered with.
    pub incoming: PropFlags,
}

fn flags_text(f: PropFlags) -> &'static str {
    match (f.private, f.sticky) {
        (false, false) => "public",
        (true, false) => "private",
        (false, true) => "public+sticky",
        (true, true) => "private+sticky",
    }
}

/// The context of one task or event on one site.
///
/// ```
/// use rankexec_protocol::{FlContext, PropFlags};
/// let mut ctx = FlContext::new();
/// ctx.set_prop("lr", 0.1, PropFlags::STICKY).unwrap();
/// // Changing the flags of an existing key is refused.
/// assert!(ctx.set_prop("lr", 0.2, PropFlags::PRIVATE).is_err());
/// assert_eq!(ctx.get_prop("lr").and_then(|v| v.as_f64()), Some(0.1));
/// ```
#[derive(Clone, Default)]
pub struct FlContext {
    props: BTreeMap<String, Prop>,
    engine: Option<Arc<dyn Engine>>,
}

impl fmt::Debug for FlContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlContext")
            .field("props", &self.props)
            .field(
                "engine",
                &self.engine.as_ref().map(|e| e.identity().to_owned()),
            )
            .finish()
    }
}

impl FlContext {
    /// An empty context with no engine.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty context bound to `engine`.
    pub fn with_engine(engine: Arc<dyn Engine>) -> Self {
        FlContext {
            props: BTreeMap::new(),
            engine: Some(engine),
        }
    }

    /// A context with these properties.
    pub fn from_props(props: BTreeMap<String, Prop>) -> Self {
        FlContext {
            props,
            engine: None,
        }
    }

    /// The engine this context belongs to, if any.
    pub fn engine(&self) -> Option<&Arc<dyn Engine>> {
        self.engine.as_ref()
    }

    /// Binds the context to an engine.
    pub fn set_engine(&mut self, engine: Arc<dyn Engine>) {
        self.engine = Some(engine);
    }

    /// Sets a property. An existing key keeps its flags: offering other flags is a
    /// [`PropConflict`] and leaves the property unchanged.
    pub fn set_prop(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
        flags: PropFlags,
    ) -> Result<(), PropConflict> {
        let key = key.into();
        if let Some(existing) = self.props.get_mut(&key) {
            let have = PropFlags {
                private: existing.private,
                sticky: existing.sticky,
            };
            if have != flags {
                return Err(PropConflict {
                    key,
                    existing: have,
                    incoming: flags,
                });
            }
            existing.value = value.into();
            return Ok(());
        }
        self.props.insert(
            key,
            Prop {
                value: value.into(),
                private: flags.private,
                sticky: flags.sticky,
            },
        );
        Ok(())
    }

    /// A property's value.
    pub fn get_prop(&self, key: &str) -> Option<&Value> {
        self.props.get(key).map(|p| &p.value)
    }

    /// A property with its flags.
    pub fn prop(&self, key: &str) -> Option<&Prop> {
        self.props.get(key)
    }

    /// Removes a property.
    pub fn remove_prop(&mut self, key: &str) -> Option<Prop> {
        self.props.remove(key)
    }

    /// All properties.
    pub fn props(&self) -> &BTreeMap<String, Prop> {
        &self.props
    }

    /// Applies `incoming` by the merge rule in the module docs and returns the conflicts.
    pub fn merge_from<I>(&mut self, incoming: I) -> Vec<PropConflict>
    where
        I: IntoIterator<Item = (String, Prop)>,
    {
        let mut conflicts = Vec::new();
        for (key, prop) in incoming {
            let flags = PropFlags {
                private: prop.private,
                sticky: prop.sticky,
            };
            if let Err(c) = self.set_prop(key, prop.value, flags) {
                conflicts.push(c);
            }
        }
        conflicts
    }

    /// The sticky properties, to seed later contexts.
    pub fn sticky_props(&self) -> BTreeMap<String, Prop> {
        self.props
            .iter()
            .filter(|(_, p)| p.sticky)
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect()
    }

    /// The properties a site may share with its peers (all but the private ones).
    pub fn peer_props(&self) -> BTreeMap<String, Prop> {
        self.props
            .iter()
            .filter(|(_, p)| !p.private)
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prop(v: i64, private: bool, sticky: bool) -> Prop {
        Prop {
            value: Value::Int(v),
            private,
            sticky,
        }
    }

    #[test]
    fn merge_adds_updates_keeps_and_reports_conflicts() {
        let mut ctx = FlContext::new();
        ctx.set_prop("same", 1, PropFlags::PUBLIC).unwrap();
        ctx.set_prop("masked", 1, PropFlags::PRIVATE).unwrap();
        ctx.set_prop("untouched", 7, PropFlags::STICKY).unwrap();
        let conflicts = ctx.merge_from([
            ("same".to_owned(), prop(2, false, false)),
            ("masked".to_owned(), prop(9, false, true)),
            ("new".to_owned(), prop(3, true, true)),
        ]);
        assert_eq!(ctx.get_prop("same"), Some(&Value::Int(2)));
        assert_eq!(
            ctx.get_prop("masked"),
            Some(&Value::Int(1)),
            "conflict keeps ours"
        );
        assert_eq!(ctx.get_prop("new"), Some(&Value::Int(3)));
        assert_eq!(ctx.get_prop("untouched"), Some(&Value::Int(7)));
        assert_eq!(conflicts.len(), 1);
        assert_eq!(conflicts[0].key, "masked");
        assert_eq!(
            conflicts[0].to_string(),
            "property `masked` is private here and cannot become public+sticky"
        );
    }

    #[test]
    fn peer_props_leave_private_out_and_sticky_props_keep_only_sticky() {
        let mut ctx = FlContext::new();
        ctx.set_prop("a", 1, PropFlags::PRIVATE).unwrap();
        ctx.set_prop("b", 2, PropFlags::PUBLIC).unwrap();
        ctx.set_prop("c", 3, PropFlags::PRIVATE_STICKY).unwrap();
        assert_eq!(ctx.peer_props().keys().collect::<Vec<_>>(), ["b"]);
        assert_eq!(ctx.sticky_props().keys().collect::<Vec<_>>(), ["c"]);
    }
}
