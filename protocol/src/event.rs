//! Event types: the lifecycle events FLARE defines, plus any custom name.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The name of an event.
///
/// ```
/// use rankexec_protocol::EventType;
/// assert_eq!(EventType::START_RUN.as_str(), "_start_run");
/// assert!(EventType::new("my_metrics").is_custom());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EventType(Cow<'static, str>);

impl EventType {
    /// The job starts on this site: executors set up (the multi-process executor
    /// launches its ranks), then the event reaches every component and rank.
    pub const START_RUN: EventType = EventType(Cow::Borrowed("_start_run"));
    /// The job ends on this site: the event reaches every rank, then the group is torn down.
    pub const END_RUN: EventType = EventType(Cow::Borrowed("_end_run"));
    /// The running task was aborted by the controller.
    pub const ABORT_TASK: EventType = EventType(Cow::Borrowed("_abort_task"));
    /// Fired by the client runtime before a task is executed.
    pub const BEFORE_TASK_EXECUTION: EventType = EventType(Cow::Borrowed("_before_task_execution"));
    /// Fired by the client runtime after a task was executed.
    pub const AFTER_TASK_EXECUTION: EventType = EventType(Cow::Borrowed("_after_task_execution"));

    const BUILT_IN: [&'static str; 5] = [
        "_start_run",
        "_end_run",
        "_abort_task",
        "_before_task_execution",
        "_after_task_execution",
    ];

    /// A custom event.
    pub fn new(name: impl Into<String>) -> Self {
        EventType(Cow::Owned(name.into()))
    }

    /// The event's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is not one of the built-in lifecycle events.
    pub fn is_custom(&self) -> bool {
        !Self::BUILT_IN.contains(&self.as_str())
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for EventType {
    fn from(s: &str) -> Self {
        EventType::new(s)
    }
}
