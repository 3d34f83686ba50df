//! The component contract: what a user implements and what a host calls.
//!
//! - [`FlComponent`]: anything that handles events.
//! - [`Executor`]: a component that executes tasks.
//! - [`Engine`]: what components fire events into. The host provides one; inside a rank
//!   the engine relays events to the parent's engine over the event channel.
//!
//! Both traits take `&self`: a rank receives events on its handle channel while a task
//! runs on its exec channel, so a component is called from two threads at once. Keep
//! mutable state behind a `Mutex` (the examples show how).

use std::error::Error as StdError;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::context::FlContext;
use crate::event::EventType;
use crate::shareable::Shareable;
use crate::signal::Signal;

/// How a failure happened, so that a host can tell failures apart without parsing text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorClass {
    /// The component returned an error.
    Exception,
    /// The component panicked.
    Panic,
    /// A rank exited with a non-zero code.
    ExitCode,
    /// A rank was killed by a signal.
    Signal,
    /// A rank ran out of memory: it reported an allocation failure, or the OOM killer
    /// killed it.
    OutOfMemory,
    /// A deadline expired.
    Timeout,
    /// The work was aborted on request.
    Aborted,
    /// A peer broke the protocol.
    Protocol,
}

impl ErrorClass {
    /// A short lowercase name, as used in reports and `summary.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Exception => "exception",
            ErrorClass::Panic => "panic",
            ErrorClass::ExitCode => "exit_code",
            ErrorClass::Signal => "signal",
            ErrorClass::OutOfMemory => "out_of_memory",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Aborted => "aborted",
            ErrorClass::Protocol => "protocol",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error a component returns.
///
/// ```
/// use rankexec_protocol::{ComponentError, ErrorClass};
/// let e = ComponentError::out_of_memory("batch of 4096 does not fit");
/// assert_eq!(e.class(), ErrorClass::OutOfMemory);
/// ```
#[derive(Debug)]
pub struct ComponentError {
    class: ErrorClass,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl fmt::Display for ComponentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for ComponentError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

impl ComponentError {
    /// An error of the given class.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        ComponentError {
            class,
            message: message.into(),
            source: None,
        }
    }

    /// The component failed ([`ErrorClass::Exception`]).
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Exception, message)
    }

    /// The component could not allocate memory ([`ErrorClass::OutOfMemory`]). The
    /// executor may retry such a failure (see the executor's `oom_retries`).
    pub fn out_of_memory(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::OutOfMemory, message)
    }

    /// The component stopped because its abort signal fired ([`ErrorClass::Aborted`]).
    pub fn aborted() -> Self {
        Self::new(ErrorClass::Aborted, "aborted")
    }

    /// Wraps another error; its text becomes part of the chain, not of this message.
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The error's class.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The error's own message (without its sources).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message followed by every source, joined by `": "`.
    pub fn chain_text(&self) -> String {
        error_chain(self)
    }
}

/// The text of a caught panic's payload (`panic!` with a literal or a formatted message).
///
/// ```
/// let p = std::panic::catch_unwind(|| panic!("bad shard {}", 3)).unwrap_err();
/// assert_eq!(rankexec_protocol::panic_message(p.as_ref()), "bad shard 3");
/// ```
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// An error followed by every source, joined by `": "` (what `{:#}` prints in anyhow).
///
/// ```
/// use rankexec_protocol::{ComponentError, error_chain};
/// let e = ComponentError::failed("cannot load").with_source(std::io::Error::other("disk full"));
/// assert_eq!(error_chain(&e), "cannot load: disk full");
/// ```
pub fn error_chain(e: &dyn StdError) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

/// Why an event could not be fired through an [`Engine`].
#[derive(Debug, thiserror::Error)]
pub enum FireEventError {
    /// The parent did not answer within the event deadline.
    #[error("no reply to event `{event}` within {timeout_ms} ms")]
    Timeout {
        /// The event.
        event: String,
        /// The deadline that expired.
        timeout_ms: u64,
    },
    /// The connection to the parent is gone.
    #[error("the connection to the parent is closed")]
    Disconnected,
    /// The event could not be sent (too large for the parent, say).
    #[error("cannot send event `{event}`")]
    Send {
        /// The event.
        event: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A handler failed.
    #[error("handler `{component}` failed on event `{event}`")]
    Handler {
        /// The component whose handler failed.
        component: String,
        /// The event.
        event: String,
        /// The handler's error.
        #[source]
        source: ComponentError,
    },
    /// The parent reported an error while firing the event.
    #[error("the parent failed to fire event `{event}`: {message}")]
    Remote {
        /// The event.
        event: String,
        /// What the parent reported.
        message: String,
    },
}

/// Handles events. Every component is one.
pub trait FlComponent: Send + Sync + 'static {
    /// Called for every event fired on this site. The default does nothing.
    fn handle_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), ComponentError> {
        let _ = (event, ctx);
        Ok(())
    }
}

/// Executes tasks.
///
/// ```
/// use rankexec_protocol::{ComponentError, Executor, FlComponent, FlContext, Shareable, Signal};
///
/// struct Double;
/// impl FlComponent for Double {}
/// impl Executor for Double {
///     fn execute(&self, _task: &str, input: Shareable, _ctx: &mut FlContext, _abort: &Signal)
///         -> Result<Shareable, ComponentError> {
///         let x = input.meta("x").and_then(|v| v.as_i64()).ok_or_else(|| ComponentError::failed("missing x"))?;
///         Ok(Shareable::new().with_meta("y", 2 * x))
///     }
/// }
/// let out = Double.execute("t", Shareable::new().with_meta("x", 4), &mut FlContext::new(), &Signal::new()).unwrap();
/// assert_eq!(out.meta("y").and_then(|v| v.as_i64()), Some(8));
/// ```
pub trait Executor: FlComponent {
    /// Runs `task` on `input`. Long-running work must watch `abort` and return
    /// [`ComponentError::aborted`] soon after it fires.
    fn execute(
        &self,
        task: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError>;
}

/// What components fire events into.
pub trait Engine: Send + Sync + 'static {
    /// Fires `event` to every component of this site; handlers may update `ctx`.
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError>;
    /// The site's name (e.g. `site-1`).
    fn identity(&self) -> &str;
    /// The job's id.
    fn job_id(&self) -> &str;
    /// The site's workspace directory for this job.
    fn workspace(&self) -> &Path;
}
