//! The messages that cross the wire, and which channel carries each.
//!
//! Every rank holds three connections to its parent:
//!
//! | channel | parent → rank | rank → parent |
//! |---|---|---|
//! | [`Channel::Exec`] | `Init`, `Execute`, `Close` | `InitAck`, `TaskResult` |
//! | [`Channel::Handle`] | `HandleEvent`, `Abort`, `Close` | `EventAck` |
//!
//! `Abort` travels on the handle channel: a rank runs its task on the thread that reads
//! the exec channel, and its handle thread, which runs no component code (event
//! handlers run on another thread), fires the task's signal at once.
//! | [`Channel::Event`] | `EventReply` | `FireEvent`, `Heartbeat` |
//!
//! Before any of these, each connection completes the [`Handshake`] (see
//! [`handshake`](super::handshake)). A message on the wrong channel or in the wrong
//! direction is a protocol violation.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::component::ErrorClass;
use crate::context::Prop;
use crate::event::EventType;
use crate::value::Value;

/// The protocol version. Both sides must agree exactly.
pub const PROTOCOL_VERSION: u32 = 1;

/// Context properties on the wire.
pub type Props = BTreeMap<String, Prop>;

/// A 32-byte random nonce.
pub type Nonce = [u8; 32];

/// A 32-byte HMAC-SHA256 tag.
pub type Mac = [u8; 32];

/// The three connections of a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Channel {
    /// Tasks: init, execute, abort, close; results come back on it.
    Exec,
    /// Events from the parent to the rank, acknowledged by the rank.
    Handle,
    /// Events fired inside the rank, relayed to the parent; heartbeats.
    Event,
}

impl Channel {
    /// All channels, in connection order.
    pub const ALL: [Channel; 3] = [Channel::Exec, Channel::Handle, Channel::Event];

    /// A lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Exec => "exec",
            Channel::Handle => "handle",
            Channel::Event => "event",
        }
    }

    /// A dense index (0..3).
    pub fn index(self) -> usize {
        match self {
            Channel::Exec => 0,
            Channel::Handle => 1,
            Channel::Event => 2,
        }
    }
}

/// Messages exchanged before a connection is authenticated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Handshake {
    /// Parent → rank, first frame on every connection.
    Challenge {
        /// The parent's protocol version.
        version: u32,
        /// The parent's nonce.
        #[serde(with = "serde_bytes")]
        nonce: Nonce,
    },
    /// Rank → parent: who the rank is, and its proof of the secret.
    Hello(Hello),
    /// Parent → rank: accepted, with the parent's proof of the secret.
    Welcome {
        /// HMAC over both nonces with the server label.
        #[serde(with = "serde_bytes")]
        mac: Mac,
    },
    /// Parent → rank: refused, and why.
    Refused {
        /// The reason, also logged by the parent.
        reason: String,
    },
}

/// Who a rank says it is on one of its connections.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    /// Which connection this is.
    pub channel: Channel,
    /// The rank's global rank.
    pub rank: u32,
    /// The world size the rank believes in.
    pub world_size: u32,
    /// The launch this rank belongs to.
    pub launch_id: String,
    /// The rank's process id.
    pub pid: u32,
    /// The rank's process group id.
    pub pgid: u32,
    /// The rank's host name.
    pub host: String,
}

/// A rank's introduction on one of its connections. (bincode writes a nested struct's
/// fields in place, so this encodes exactly as the flat list of fields.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The rank's protocol version.
    pub version: u32,
    /// Who the rank says it is.
    pub who: Identity,
    /// The rank's nonce.
    #[serde(with = "serde_bytes")]
    pub nonce: Nonce,
    /// HMAC over the challenge, the nonce and every field above.
    #[serde(with = "serde_bytes")]
    pub mac: Mac,
}

/// A component configuration on the wire (JSON args as text: the codec is not
/// self-describing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireComponent {
    /// The component id.
    pub id: String,
    /// The registered path.
    pub path: String,
    /// The args as JSON text.
    pub args_json: String,
}

/// Parent → rank: what to build and how to behave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Init {
    /// The id of the component that executes tasks.
    pub executor_id: String,
    /// Every component to build, in order.
    pub components: Vec<WireComponent>,
    /// The start-up context.
    pub props: Props,
    /// How often the rank sends a heartbeat.
    pub heartbeat_interval_ms: u64,
    /// How long the rank waits for the parent to answer a fired event.
    pub event_timeout_ms: u64,
    /// Blobs at least this large go back as sealed memory files on local connections.
    pub zero_copy_threshold: u64,
    /// The largest frame the parent accepts (header plus inline blobs; memory files
    /// are not counted).
    pub max_frame_bytes: u64,
}

/// How a blob's bytes travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Carrier {
    /// Raw bytes in the frame body, in header order.
    Inline,
    /// A sealed memory file passed with the frame; the number indexes the frame's files.
    Fd(u32),
    /// Bytes at `offset` (a multiple of the page size) of a sealed memory file passed
    /// with the frame: several blobs share one file, so a model of any number of
    /// tensors passes a few descriptors.
    FdAt {
        /// Which of the frame's files.
        index: u32,
        /// Where the blob starts in it.
        offset: u64,
    },
}

impl Carrier {
    /// The file index and offset of a blob passed as a memory file.
    pub fn file(self) -> Option<(u32, u64)> {
        match self {
            Carrier::Inline => None,
            Carrier::Fd(index) => Some((index, 0)),
            Carrier::FdAt { index, offset } => Some((index, offset)),
        }
    }
}

/// A blob's description in a header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobHeader {
    /// The blob's name.
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// How its bytes travel.
    pub carrier: Carrier,
}

/// A shareable's metadata plus its blob descriptions.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct WireShareable {
    /// Metadata.
    pub meta: BTreeMap<String, Value>,
    /// Blob descriptions; the bytes follow the header or come as files.
    pub blobs: Vec<BlobHeader>,
}

/// Parent → rank: run a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Execute {
    /// Unique per executor; results and aborts name it.
    pub task_id: u64,
    /// The task name.
    pub task: String,
    /// The task's context.
    pub props: Props,
    /// The input.
    pub input: WireShareable,
    /// Whether every rank must return its output (the `gather` policy). Rank 0 always
    /// does; other ranks otherwise report only success or failure. One value for all
    /// ranks, so the frame is encoded once and written to every rank.
    pub want_output: bool,
}

/// A failure reported by a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankError {
    /// What kind of failure.
    pub class: ErrorClass,
    /// The error with its sources.
    pub message: String,
}

/// Rank → parent: a task's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskOutput {
    /// The rank's context after the task.
    pub props: Props,
    /// The output (empty when not wanted).
    pub output: WireShareable,
}

/// Every message after authentication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Parent → rank (exec): build components.
    Init(Box<Init>),
    /// Rank → parent (exec): components built, or why not.
    InitAck {
        /// `Ok` or the build error.
        result: Result<(), RankError>,
    },
    /// Parent → rank (exec): run a task.
    Execute(Box<Execute>),
    /// Parent → rank (handle): fire the task's abort signal.
    Abort {
        /// The task to abort.
        task_id: u64,
        /// Why.
        reason: String,
    },
    /// Rank → parent (exec): a task finished.
    TaskResult {
        /// The task.
        task_id: u64,
        /// The output, or the failure.
        outcome: Result<TaskOutput, RankError>,
    },
    /// Parent → rank (handle): deliver an event to every component.
    HandleEvent {
        /// Unique per executor.
        event_id: u64,
        /// The event.
        event: EventType,
        /// The event's context.
        props: Props,
    },
    /// Rank → parent (handle): the event was handled.
    EventAck {
        /// The event.
        event_id: u64,
        /// The context after the handlers ran, or the first handler error.
        result: Result<Props, RankError>,
    },
    /// Rank → parent (event): a component fired an event inside the rank.
    FireEvent {
        /// Unique per rank.
        request_id: u64,
        /// The event.
        event: EventType,
        /// The rank's context.
        props: Props,
    },
    /// Parent → rank (event): the event was fired on the parent's engine.
    EventReply {
        /// The request.
        request_id: u64,
        /// The context after the parent's handlers ran, or what failed.
        result: Result<Props, String>,
    },
    /// Rank → parent (event): the rank is alive.
    Heartbeat {
        /// Increments by one per heartbeat.
        seq: u64,
    },
    /// Parent → rank (exec and handle): shut down cleanly.
    Close {
        /// Why.
        reason: String,
    },
}

impl Message {
    /// A short name for logs and protocol errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Init(_) => "Init",
            Message::InitAck { .. } => "InitAck",
            Message::Execute(_) => "Execute",
            Message::Abort { .. } => "Abort",
            Message::TaskResult { .. } => "TaskResult",
            Message::HandleEvent { .. } => "HandleEvent",
            Message::EventAck { .. } => "EventAck",
            Message::FireEvent { .. } => "FireEvent",
            Message::EventReply { .. } => "EventReply",
            Message::Heartbeat { .. } => "Heartbeat",
            Message::Close { .. } => "Close",
        }
    }

    /// Whether the parent may receive this message on `channel`.
    pub fn valid_from_rank(&self, channel: Channel) -> bool {
        matches!(
            (channel, self),
            (
                Channel::Exec,
                Message::InitAck { .. } | Message::TaskResult { .. }
            ) | (Channel::Handle, Message::EventAck { .. })
                | (
                    Channel::Event,
                    Message::FireEvent { .. } | Message::Heartbeat { .. }
                )
        )
    }

    /// Whether a rank may receive this message on `channel`.
    pub fn valid_from_parent(&self, channel: Channel) -> bool {
        matches!(
            (channel, self),
            (
                Channel::Exec,
                Message::Init(_) | Message::Execute(_) | Message::Close { .. }
            ) | (
                Channel::Handle,
                Message::HandleEvent { .. } | Message::Abort { .. } | Message::Close { .. }
            ) | (Channel::Event, Message::EventReply { .. })
        )
    }
}
