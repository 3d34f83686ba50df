//! Errors: one small enum per operation.
//!
//! Messages are lowercase fragments that do not repeat their source; print the chain
//! (`{:#}` with anyhow, or walk `source()`) for the whole story. Every rank failure is a
//! [`RankFailure`] that names the rank, its pid, the cause, the last lines of its stderr
//! and the message from its `error.json`; when several ranks fail, the earliest is the
//! root cause (torchrun's rule).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rankexec_protocol::ErrorClass;
use rankexec_protocol::wire::message::RankError;
use rankexec_protocol::wire::{Channel, PackError};

use crate::admission::AdmissionError;
use crate::config::ConfigError;
use crate::os::{ExitStatus, TermSignal};

/// An error a rank reported over the protocol (its component failed or panicked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError(pub RankError);

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.0.message, self.0.class)
    }
}

impl std::error::Error for RemoteError {}

/// What went wrong with a rank.
#[derive(Debug, Clone, PartialEq)]
pub enum FailureCause {
    /// The process ended.
    Exited(ExitStatus),
    /// The kernel's OOM killer killed it.
    OomKilled,
    /// A rank we did not spawn closed a connection (its process is gone).
    ConnectionClosed(Channel),
    /// Its component failed or panicked, as the rank reported.
    Reported(RankError),
    /// It stopped sending heartbeats.
    Unresponsive(Duration),
    /// It broke the protocol.
    Protocol {
        /// On which channel.
        channel: Channel,
        /// What it did.
        what: String,
    },
}

/// One rank's failure, with everything known about it.
#[derive(Debug, Clone, PartialEq)]
pub struct RankFailure {
    /// The rank.
    pub rank: u32,
    /// Its process id, if known.
    pub pid: Option<u32>,
    /// What happened.
    pub cause: FailureCause,
    /// The last lines of its stderr.
    pub stderr_tail: Vec<String>,
    /// The message from its torchrun-style `error.json`, if it left one.
    pub error_file: Option<String>,
    /// When, since the group started (the earliest failure is the root cause).
    pub after: Duration,
}

impl RankFailure {
    /// How the rank failed.
    pub fn class(&self) -> ErrorClass {
        match &self.cause {
            FailureCause::Exited(ExitStatus::Code(_)) => ErrorClass::ExitCode,
            FailureCause::Exited(ExitStatus::Signal { .. }) => ErrorClass::Signal,
            FailureCause::Exited(ExitStatus::Unknown) | FailureCause::ConnectionClosed(_) => {
                ErrorClass::ExitCode
            }
            FailureCause::OomKilled => ErrorClass::OutOfMemory,
            FailureCause::Reported(e) => e.class,
            FailureCause::Unresponsive(_) => ErrorClass::Timeout,
            FailureCause::Protocol { .. } => ErrorClass::Protocol,
        }
    }

    /// A multi-line report: the failure, then its stderr tail.
    pub fn report(&self) -> String {
        format!("rank {}: {self}{}", self.rank, self.stderr_report())
    }

    /// The stderr tail as indented lines after a newline (empty when there is none):
    /// what a report adds to a one-line error that already names the failure.
    pub fn stderr_report(&self) -> String {
        let mut s = String::new();
        if !self.stderr_tail.is_empty() {
            s.push_str(&format!(
                "\n  last {} lines of stderr:",
                self.stderr_tail.len()
            ));
            for l in &self.stderr_tail {
                s.push_str("\n    ");
                s.push_str(l);
            }
        }
        s
    }
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = match self.pid {
            Some(pid) => format!("pid {pid}"),
            None => "the rank".to_owned(),
        };
        match &self.cause {
            FailureCause::Exited(ExitStatus::Code(c)) => write!(f, "{who} exited with code {c}")?,
            FailureCause::Exited(st @ ExitStatus::Signal { .. }) => {
                write!(f, "{who} was killed by {st}")?
            }
            FailureCause::Exited(ExitStatus::Unknown) => write!(f, "{who} exited")?,
            FailureCause::OomKilled => write!(f, "{who} was killed by the kernel OOM killer")?,
            FailureCause::ConnectionClosed(ch) => {
                write!(f, "{who} closed its {} channel (process gone)", ch.as_str())?
            }
            FailureCause::Reported(e) => write!(f, "{}: {}", e.class, e.message)?,
            FailureCause::Unresponsive(d) => write!(f, "{who} sent no heartbeat for {d:.1?}")?,
            FailureCause::Protocol { channel, what } => write!(
                f,
                "{who} broke the protocol on the {} channel: {what}",
                channel.as_str()
            )?,
        }
        if let Some(msg) = &self.error_file {
            write!(f, "; error.json: {msg}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RankFailure {}

impl RankFailure {
    /// Whether the rank died from outside its own code: a signal sent to it (not a
    /// fault of its own: `SIGSEGV`, `SIGBUS`, `SIGILL`, `SIGFPE`, `SIGABRT`, `SIGSYS`,
    /// `SIGTRAP`), the kernel's OOM killer, a rank we did not spawn whose connection
    /// closed (its node or launcher is gone), or silence past the heartbeat deadline (a
    /// lost node or link). Running the task again may then succeed; an exception, an
    /// exit code, a fault or a protocol violation would only repeat.
    pub fn from_outside(&self) -> bool {
        match &self.cause {
            FailureCause::Exited(ExitStatus::Signal { signal, .. }) => ![
                libc::SIGSEGV,
                libc::SIGBUS,
                libc::SIGILL,
                libc::SIGFPE,
                libc::SIGABRT,
                libc::SIGSYS,
                libc::SIGTRAP,
            ]
            .contains(signal),
            FailureCause::OomKilled
            | FailureCause::ConnectionClosed(_)
            | FailureCause::Unresponsive(_) => true,
            FailureCause::Exited(_) | FailureCause::Reported(_) | FailureCause::Protocol { .. } => {
                false
            }
        }
    }
}

/// One try of a task that a rank's death from outside ended; the task was then run
/// again on a relaunched group (`restart.retry_task`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRetry {
    /// Which try failed (1: the first run). 0: the rank died between tasks, before
    /// this task began; it ran on a relaunched group instead of failing.
    pub attempt: u32,
    /// The death that ended it.
    pub failure: RankFailure,
}

impl fmt::Display for TaskRetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.attempt {
            0 => write!(
                f,
                "before the task: rank {}: {}",
                self.failure.rank, self.failure
            ),
            n => write!(f, "try {n}: rank {}: {}", self.failure.rank, self.failure),
        }
    }
}

/// `try 1: rank 1: ...; try 2: ...`.
pub fn describe_retries(retries: &[TaskRetry]) -> String {
    retries
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why the group could not start.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StartError {
    /// The executor was finalized.
    #[error("the executor is finalized")]
    Finalized,
    /// The configuration is invalid.
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// Resources did not allow it.
    #[error("admission refused")]
    Admission(#[source] AdmissionError),
    /// The private run directory could not be made.
    #[error("cannot prepare the run directory")]
    RunDir(#[source] Arc<std::io::Error>),
    /// The log directory could not be made.
    #[error("cannot prepare the log directory {path}")]
    LogDir {
        /// The directory.
        path: String,
        /// Why.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The listener could not be created.
    #[error("cannot listen on {endpoint}")]
    Listen {
        /// Where.
        endpoint: String,
        /// Why.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A process could not be spawned.
    #[error("cannot spawn {what} `{program}`")]
    Spawn {
        /// `rank N` or `the launcher`.
        what: String,
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A rank failed while starting (exited before hello, crashed, broke the protocol).
    #[error("rank {} failed during start-up", .0.rank)]
    RankFailed(#[source] Box<RankFailure>),
    /// A rank could not build its components.
    #[error("rank {rank} could not build its components")]
    Build {
        /// The rank.
        rank: u32,
        /// What it reported.
        #[source]
        error: RemoteError,
    },
    /// A connection's reader or writer thread could not be started.
    #[error("cannot start the connection threads of rank {rank}")]
    Threads {
        /// The rank.
        rank: u32,
        /// Why.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The `Init` message (component configurations and context) could not be encoded.
    #[error("cannot encode the start-up message for the ranks")]
    Encode(#[source] Arc<rankexec_protocol::wire::codec::CodecError>),
    /// The external launcher exited before every rank was ready.
    #[error("the launcher exited with {status} before every rank was ready")]
    LauncherExited {
        /// How it exited.
        status: ExitStatus,
        /// The last lines it printed.
        tail: Vec<String>,
    },
    /// The deadline passed.
    #[error("start-up did not complete within {timeout:?}: {missing}")]
    Timeout {
        /// The deadline.
        timeout: Duration,
        /// What was still missing.
        missing: String,
    },
    /// Start-up was interrupted by a finalize or job abort.
    #[error("start-up was aborted")]
    Aborted,
    /// The dispatcher thread is gone (a bug).
    #[error("the executor's dispatcher thread is gone")]
    DispatcherGone,
}

/// Why results could not be averaged (the `gather` policy, or FedAvg on a server).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GatherError {
    /// A result lacks a blob to average.
    #[error("{who} returned no blob `{name}`")]
    MissingBlob {
        /// Whose result (`rank 1`, `site-2`).
        who: String,
        /// The blob.
        name: String,
    },
    /// Blob sizes differ.
    #[error("{who}'s blob `{name}` has {len} bytes, the first result's has {expected}")]
    LengthMismatch {
        /// Whose result.
        who: String,
        /// The blob.
        name: String,
        /// Its length.
        len: usize,
        /// The first result's length.
        expected: usize,
    },
    /// A blob is not a whole number of `f32`s.
    #[error("blob `{name}` has {len} bytes, not a multiple of 4 (f32)")]
    NotF32 {
        /// The blob.
        name: String,
        /// Its length.
        len: usize,
    },
    /// A result lacks its weight.
    #[error("{who} returned no numeric meta `{key}`")]
    MissingWeight {
        /// Whose result.
        who: String,
        /// The key.
        key: String,
    },
    /// The weights add up to zero or less.
    #[error("the weights `{key}` add up to {total}")]
    ZeroWeight {
        /// The key.
        key: String,
        /// Their sum.
        total: f64,
    },
    /// There is nothing to average.
    #[error("no results to average")]
    Empty,
}

/// Why a task failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ExecuteError {
    /// A rank failed; `others` are later failures (collateral or independent).
    #[error("rank {} failed", failure.rank)]
    RankFailed {
        /// The root cause: the earliest failure.
        #[source]
        failure: Box<RankFailure>,
        /// Other ranks that failed afterwards.
        others: Vec<RankFailure>,
    },
    /// The task was aborted; `forced` when ranks did not return within the grace and the
    /// group was killed (the next task relaunches it).
    #[error("task `{task}` was aborted ({reason}){}", if *.forced { "; ranks did not stop in time and the group was killed" } else { "" })]
    Aborted {
        /// The task.
        task: String,
        /// Why.
        reason: String,
        /// Whether the group had to be killed.
        forced: bool,
    },
    /// The task deadline passed; the group was torn down.
    #[error("task `{task}` did not finish within {timeout:?} (still running: ranks {pending:?})")]
    Timeout {
        /// The task.
        task: String,
        /// The deadline.
        timeout: Duration,
        /// Ranks that had not returned.
        pending: Vec<u32>,
    },
    /// The group could not be (re)started.
    #[error("cannot start the rank group")]
    Start(#[source] StartError),
    /// Relaunches are used up.
    #[error("giving up after {restarts} relaunches")]
    RestartsExhausted {
        /// How many relaunches were made.
        restarts: u32,
        /// The last failure.
        #[source]
        last: Box<ExecuteError>,
    },
    /// The task was run again after ranks died from outside (`restart.retry_task`), and
    /// its last try failed with `last`.
    #[error("retried {} time{} after ranks died ({}); the last try", retries.len(), if retries.len() == 1 { "" } else { "s" }, describe_retries(retries))]
    Retried {
        /// The tries that a rank's death ended, in order.
        retries: Vec<TaskRetry>,
        /// How the last try failed.
        #[source]
        last: Box<ExecuteError>,
    },
    /// The results could not be combined.
    #[error("cannot combine the ranks' results")]
    Gather(#[source] GatherError),
    /// The input could not be sent.
    #[error("cannot send the task input")]
    Input(#[source] Arc<PackError>),
    /// The executor was finalized.
    #[error("the executor is finalized")]
    Finalized,
    /// The dispatcher thread is gone (a bug).
    #[error("the executor's dispatcher thread is gone")]
    DispatcherGone,
}

impl ExecuteError {
    /// How the task failed.
    pub fn class(&self) -> ErrorClass {
        match self {
            ExecuteError::RankFailed { failure, .. } => failure.class(),
            ExecuteError::Aborted { .. } | ExecuteError::Finalized => ErrorClass::Aborted,
            ExecuteError::Timeout { .. } => ErrorClass::Timeout,
            ExecuteError::RestartsExhausted { last, .. } | ExecuteError::Retried { last, .. } => {
                last.class()
            }
            ExecuteError::Start(StartError::RankFailed(f)) => f.class(),
            ExecuteError::Start(StartError::Build { error, .. }) => error.0.class,
            ExecuteError::Start(StartError::Timeout { .. }) => ErrorClass::Timeout,
            ExecuteError::Start(StartError::Aborted) => ErrorClass::Aborted,
            ExecuteError::Start(_)
            | ExecuteError::Gather(_)
            | ExecuteError::Input(_)
            | ExecuteError::DispatcherGone => ErrorClass::Exception,
        }
    }

    /// The rank failure at the root of this error, if there is one.
    pub fn root_cause(&self) -> Option<&RankFailure> {
        match self {
            ExecuteError::RankFailed { failure, .. } => Some(failure),
            ExecuteError::RestartsExhausted { last, .. } | ExecuteError::Retried { last, .. } => {
                last.root_cause()
            }
            ExecuteError::Start(StartError::RankFailed(f)) => Some(f),
            _ => None,
        }
    }
}

/// Why an event could not be delivered to the ranks.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EventError {
    /// A rank's handler failed.
    #[error("rank {rank} failed to handle event `{event}`")]
    Rank {
        /// The rank.
        rank: u32,
        /// The event.
        event: String,
        /// What it reported.
        #[source]
        error: RemoteError,
    },
    /// Some ranks did not acknowledge in time; the group was torn down.
    #[error("event `{event}` was not acknowledged within {timeout:?} by ranks {pending:?}")]
    Timeout {
        /// The event.
        event: String,
        /// The deadline.
        timeout: Duration,
        /// Ranks that did not answer.
        pending: Vec<u32>,
    },
    /// A rank failed while the event was in flight.
    #[error("rank {} failed while event `{event}` was delivered", failure.rank)]
    RankFailed {
        /// The event.
        event: String,
        /// The failure.
        #[source]
        failure: Box<RankFailure>,
    },
    /// The event (its context) could not be encoded.
    #[error("cannot encode event `{event}` for the ranks")]
    Encode {
        /// The event.
        event: String,
        /// Why.
        #[source]
        source: Arc<rankexec_protocol::wire::codec::CodecError>,
    },
    /// The group could not start (START_RUN).
    #[error("cannot start the rank group")]
    Start(#[source] StartError),
    /// The executor was finalized.
    #[error("the executor is finalized")]
    Finalized,
    /// The dispatcher thread is gone (a bug).
    #[error("the executor's dispatcher thread is gone")]
    DispatcherGone,
}

/// What a finalize did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FinalizeReport {
    /// How long teardown took.
    pub elapsed: Duration,
    /// The strongest signal that had to be sent (`None`: every rank exited on `Close`).
    pub escalated: Option<TermSignal>,
    /// Pids still present after `SIGKILL` and the final wait (e.g. stuck in the kernel).
    pub unkillable: Vec<u32>,
}

/// Why finalize could not run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FinalizeError {
    /// The dispatcher thread is gone (a bug).
    #[error("the executor's dispatcher thread is gone")]
    DispatcherGone,
}
