//! Property tests: every message survives the codec, a frame and the envelope unchanged,
//! and no byte string makes a header decoder panic.
//!
//! The strategies cover every variant of [`Message`] and [`Handshake`]; the
//! `variant_name` helpers match exhaustively, so adding a variant fails to compile here
//! until a strategy generates it. Floats exclude NaN where values are compared with `==`
//! (NaN != NaN); one property compares re-encoded bytes instead, NaN included.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use bytes::Bytes;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use rankexec_protocol::wire::codec;
use rankexec_protocol::wire::envelope::{self, BlobPolicy};
use rankexec_protocol::wire::frame::{FrameLimits, read_frame};
use rankexec_protocol::wire::message::{
    BlobHeader, Carrier, Channel, Execute, Handshake, Hello, Identity, Init, Message, Props,
    RankError, TaskOutput, WireComponent, WireShareable,
};
use rankexec_protocol::wire::{Conn, OutFrame};
use rankexec_protocol::{Blob, ErrorClass, EventType, Prop, Shareable, Value};

const CASES: u32 = 192;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------
// Strategies.

/// Short strings from any Unicode scalar values, NUL and controls included.
fn text() -> impl Strategy<Value = String> {
    vec(any::<char>(), 0..12).prop_map(|c| c.into_iter().collect())
}

fn float() -> impl Strategy<Value = f64> {
    any::<f64>().prop_filter("NaN never equals itself", |f| !f.is_nan())
}

/// Any float, NaN payloads included.
fn any_float() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<f64>(),
        any::<u64>().prop_map(f64::from_bits),
        Just(f64::NAN),
        Just(-0.0),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
    ]
}

fn value_with(float: impl Strategy<Value = f64> + 'static) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        float.prop_map(Value::Float),
        text().prop_map(Value::Str),
        vec(any::<u8>(), 0..48).prop_map(Value::Bytes),
    ];
    // Depth at most 6, far below MAX_DEPTH (64).
    leaf.prop_recursive(6, 48, 5, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..5).prop_map(Value::List),
            btree_map(text(), inner, 0..5).prop_map(Value::Map),
        ]
    })
}

fn value() -> impl Strategy<Value = Value> {
    value_with(float())
}

fn prop_() -> impl Strategy<Value = Prop> {
    (value(), any::<bool>(), any::<bool>()).prop_map(|(value, private, sticky)| Prop {
        value,
        private,
        sticky,
    })
}

fn props() -> impl Strategy<Value = Props> {
    btree_map(text(), prop_(), 0..4)
}

fn meta() -> impl Strategy<Value = BTreeMap<String, Value>> {
    btree_map(text(), value(), 0..4)
}

fn error_class() -> impl Strategy<Value = ErrorClass> {
    prop::sample::select(ALL_CLASSES.to_vec())
}

const ALL_CLASSES: [ErrorClass; 8] = [
    ErrorClass::Exception,
    ErrorClass::Panic,
    ErrorClass::ExitCode,
    ErrorClass::Signal,
    ErrorClass::OutOfMemory,
    ErrorClass::Timeout,
    ErrorClass::Aborted,
    ErrorClass::Protocol,
];

/// Exhaustive: a new class fails to compile here until it is added to `ALL_CLASSES`.
fn class_index(c: ErrorClass) -> usize {
    match c {
        ErrorClass::Exception => 0,
        ErrorClass::Panic => 1,
        ErrorClass::ExitCode => 2,
        ErrorClass::Signal => 3,
        ErrorClass::OutOfMemory => 4,
        ErrorClass::Timeout => 5,
        ErrorClass::Aborted => 6,
        ErrorClass::Protocol => 7,
    }
}

fn rank_error() -> impl Strategy<Value = RankError> {
    (error_class(), text()).prop_map(|(class, message)| RankError { class, message })
}

fn event_type() -> impl Strategy<Value = EventType> {
    prop_oneof![
        Just(EventType::START_RUN),
        Just(EventType::END_RUN),
        Just(EventType::ABORT_TASK),
        Just(EventType::BEFORE_TASK_EXECUTION),
        Just(EventType::AFTER_TASK_EXECUTION),
        text().prop_map(EventType::new),
    ]
}

fn channel() -> impl Strategy<Value = Channel> {
    prop::sample::select(Channel::ALL.to_vec())
}

fn carrier() -> impl Strategy<Value = Carrier> {
    prop_oneof![
        Just(Carrier::Inline),
        any::<u32>().prop_map(Carrier::Fd),
        (any::<u32>(), any::<u64>()).prop_map(|(index, offset)| Carrier::FdAt { index, offset }),
    ]
}

fn blob_header() -> impl Strategy<Value = BlobHeader> {
    (text(), any::<u64>(), carrier()).prop_map(|(name, len, carrier)| BlobHeader {
        name,
        len,
        carrier,
    })
}

fn wire_shareable() -> impl Strategy<Value = WireShareable> {
    (meta(), vec(blob_header(), 0..4)).prop_map(|(meta, blobs)| WireShareable { meta, blobs })
}

fn wire_component() -> impl Strategy<Value = WireComponent> {
    (text(), text(), text()).prop_map(|(id, path, args_json)| WireComponent {
        id,
        path,
        args_json,
    })
}

fn init() -> impl Strategy<Value = Init> {
    (
        text(),
        vec(wire_component(), 0..4),
        props(),
        any::<[u64; 4]>(),
    )
        .prop_map(|(executor_id, components, props, n)| Init {
            executor_id,
            components,
            props,
            heartbeat_interval_ms: n[0],
            event_timeout_ms: n[1],
            zero_copy_threshold: n[2],
            max_frame_bytes: n[3],
        })
}

fn execute() -> impl Strategy<Value = Execute> {
    (
        any::<u64>(),
        text(),
        props(),
        wire_shareable(),
        any::<bool>(),
    )
        .prop_map(|(task_id, task, props, input, want_output)| Execute {
            task_id,
            task,
            props,
            input,
            want_output,
        })
}

fn task_output() -> impl Strategy<Value = TaskOutput> {
    (props(), wire_shareable()).prop_map(|(props, output)| TaskOutput { props, output })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        init().prop_map(|i| Message::Init(Box::new(i))),
        prop::result::maybe_err(Just(()), rank_error())
            .prop_map(|result| Message::InitAck { result }),
        execute().prop_map(|e| Message::Execute(Box::new(e))),
        (any::<u64>(), text()).prop_map(|(task_id, reason)| Message::Abort { task_id, reason }),
        (
            any::<u64>(),
            prop::result::maybe_err(task_output(), rank_error())
        )
            .prop_map(|(task_id, outcome)| Message::TaskResult { task_id, outcome }),
        (any::<u64>(), event_type(), props()).prop_map(|(event_id, event, props)| {
            Message::HandleEvent {
                event_id,
                event,
                props,
            }
        }),
        (any::<u64>(), prop::result::maybe_err(props(), rank_error()))
            .prop_map(|(event_id, result)| Message::EventAck { event_id, result }),
        (any::<u64>(), event_type(), props()).prop_map(|(request_id, event, props)| {
            Message::FireEvent {
                request_id,
                event,
                props,
            }
        }),
        (any::<u64>(), prop::result::maybe_err(props(), text()))
            .prop_map(|(request_id, result)| Message::EventReply { request_id, result }),
        any::<u64>().prop_map(|seq| Message::Heartbeat { seq }),
        text().prop_map(|reason| Message::Close { reason }),
    ]
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        any::<[u32; 5]>(),
        channel(),
        text(),
        text(),
        any::<[u8; 32]>(),
        any::<[u8; 32]>(),
    )
        .prop_map(|(n, channel, launch_id, host, nonce, mac)| Hello {
            version: n[0],
            who: Identity {
                channel,
                rank: n[1],
                world_size: n[2],
                launch_id,
                pid: n[3],
                pgid: n[4],
                host,
            },
            nonce,
            mac,
        })
}

fn handshake() -> impl Strategy<Value = Handshake> {
    prop_oneof![
        (any::<u32>(), any::<[u8; 32]>())
            .prop_map(|(version, nonce)| Handshake::Challenge { version, nonce }),
        hello().prop_map(Handshake::Hello),
        any::<[u8; 32]>().prop_map(|mac| Handshake::Welcome { mac }),
        text().prop_map(|reason| Handshake::Refused { reason }),
    ]
}

/// Exhaustive: a new message fails to compile here until `message()` generates it.
fn message_variant(m: &Message) -> &'static str {
    match m {
        Message::Init(_) => "Init",
        Message::InitAck { result: Ok(()) } => "InitAck/ok",
        Message::InitAck { result: Err(_) } => "InitAck/err",
        Message::Execute(_) => "Execute",
        Message::Abort { .. } => "Abort",
        Message::TaskResult { outcome: Ok(_), .. } => "TaskResult/ok",
        Message::TaskResult {
            outcome: Err(_), ..
        } => "TaskResult/err",
        Message::HandleEvent { .. } => "HandleEvent",
        Message::EventAck { result: Ok(_), .. } => "EventAck/ok",
        Message::EventAck { result: Err(_), .. } => "EventAck/err",
        Message::FireEvent { .. } => "FireEvent",
        Message::EventReply { result: Ok(_), .. } => "EventReply/ok",
        Message::EventReply { result: Err(_), .. } => "EventReply/err",
        Message::Heartbeat { .. } => "Heartbeat",
        Message::Close { .. } => "Close",
    }
}

/// Exhaustive, like [`message_variant`].
fn handshake_variant(h: &Handshake) -> &'static str {
    match h {
        Handshake::Challenge { .. } => "Challenge",
        Handshake::Hello(_) => "Hello",
        Handshake::Welcome { .. } => "Welcome",
        Handshake::Refused { .. } => "Refused",
    }
}

/// A shareable with random metadata and blobs of random sizes (some empty, some large
/// enough to cross a small zero-copy threshold).
fn shareable() -> impl Strategy<Value = Shareable> {
    let blob_len = prop_oneof![3 => 0usize..64, 2 => 64usize..2048, 1 => 2048usize..20_000];
    let blob = blob_len.prop_flat_map(|len| vec(any::<u8>(), len));
    // Any name: memory files get a sanitized label, so NULs and names longer than
    // memfd_create accepts must still travel.
    let name = prop_oneof![4 => text(), 1 => "[a-zé]{120,300}"];
    (meta(), btree_map(name, blob, 0..6)).prop_map(|(meta, blobs)| {
        Shareable::from_parts(
            meta,
            blobs.into_iter().map(|(k, v)| (k, Blob::from(v))).collect(),
        )
    })
}

fn policy() -> impl Strategy<Value = BlobPolicy> {
    prop_oneof![
        Just(BlobPolicy::INLINE),
        (0u64..256).prop_map(|zero_copy_threshold| BlobPolicy {
            zero_copy_threshold,
            pass_fds: true,
        }),
    ]
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// Writes `frame` from a helper thread (it may exceed the socket buffer) and reads one
/// frame on the other end.
fn through_socket(frame: &OutFrame) -> rankexec_protocol::wire::InFrame {
    let (a, b) = Conn::pair().unwrap();
    std::thread::scope(|s| {
        let writer = s.spawn(|| frame.write_to(&a));
        let got = read_frame(&b, &FrameLimits::for_max_frame(64 << 20)).unwrap();
        writer.join().unwrap().unwrap();
        got
    })
}

// ---------------------------------------------------------------------------------------
// Properties.

proptest! {
    #![proptest_config(config())]

    #[test]
    fn value_round_trips(v in value()) {
        let bytes = codec::encode(&v).unwrap();
        prop_assert_eq!(codec::decode::<Value>(&bytes).unwrap(), v);
    }

    #[test]
    fn value_round_trips_bitwise_including_nan(v in value_with(any_float())) {
        let bytes = codec::encode(&v).unwrap();
        let back: Value = codec::decode(&bytes).unwrap();
        prop_assert_eq!(codec::encode(&back).unwrap(), bytes);
    }

    #[test]
    fn props_round_trip(p in props()) {
        let bytes = codec::encode(&p).unwrap();
        prop_assert_eq!(codec::decode::<Props>(&bytes).unwrap(), p);
    }

    #[test]
    fn message_round_trips(m in message()) {
        let bytes = codec::encode(&m).unwrap();
        prop_assert_eq!(codec::decode::<Message>(&bytes).unwrap(), m);
    }

    #[test]
    fn handshake_round_trips(h in handshake()) {
        let bytes = codec::encode(&h).unwrap();
        prop_assert_eq!(codec::decode::<Handshake>(&bytes).unwrap(), h);
    }

    #[test]
    fn message_and_body_round_trip_through_a_frame(
        m in message(),
        body in vec(vec(any::<u8>(), 0..512), 0..4),
    ) {
        let segments: Vec<Bytes> = body.iter().cloned().map(Bytes::from).collect();
        let frame = envelope::frame(&m, segments, vec![]).unwrap();
        let got = through_socket(&frame);
        prop_assert_eq!(envelope::decode(&got).unwrap(), m);
        prop_assert_eq!(&got.body[..], &body.concat()[..]);
        prop_assert!(got.fds.is_empty());
    }

    #[test]
    fn shareable_round_trips_through_pack_frame_and_unpack(
        s in shareable(),
        policy in policy(),
    ) {
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let input = envelope::pack(&s, policy, &mut body, &mut fds).unwrap();
        for (h, (name, blob)) in input.blobs.iter().zip(s.blobs()) {
            prop_assert_eq!(&h.name, name);
            prop_assert_eq!(h.len, blob.len() as u64);
            let shared = policy.pass_fds && h.len >= policy.zero_copy_threshold;
            prop_assert_eq!(h.carrier.file().is_some(), shared);
        }
        let msg = Message::Execute(Box::new(Execute {
            task_id: 1,
            task: "t".to_owned(),
            props: Props::new(),
            input,
            want_output: true,
        }));
        let got = through_socket(&envelope::frame(&msg, body, fds).unwrap());
        let Message::Execute(execute) = envelope::decode(&got).unwrap() else {
            panic!("not an execute");
        };
        let back = envelope::unpack(execute.input, &got.body, got.fds).unwrap();
        prop_assert_eq!(&back, &s);
        for (name, blob) in back.blobs() {
            let shared = policy.pass_fds && blob.len() as u64 >= policy.zero_copy_threshold;
            prop_assert_eq!(blob.is_shared(), shared, "blob {:?}", name);
        }
    }

    #[test]
    fn shareable_round_trips_through_pack_and_unpack(
        s in shareable(),
        policy in policy(),
    ) {
        let (mut body, mut fds) = (Vec::new(), Vec::<Arc<OwnedFd>>::new());
        let wire = envelope::pack(&s, policy, &mut body, &mut fds).unwrap();
        let body = Bytes::from(body.concat());
        let fds: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        prop_assert_eq!(envelope::unpack(wire, &body, fds).unwrap(), s);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in vec(any::<u8>(), 0..256)) {
        let _ = codec::decode::<Message>(&bytes);
        let _ = codec::decode::<Handshake>(&bytes);
        let _ = codec::decode::<Value>(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic_the_decoders(
        m in message(),
        flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        // Valid encodings with a few bytes changed reach far deeper than random bytes.
        let mut bytes = codec::encode(&m).unwrap();
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        let _ = codec::decode::<Message>(&bytes);
        let _ = codec::decode::<Handshake>(&bytes);
    }
}

// ---------------------------------------------------------------------------------------
// Coverage of the strategies themselves.

#[test]
fn strategies_generate_every_variant_and_error_class() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    let mut runner = TestRunner::deterministic();
    let (mut messages, mut handshakes, mut classes) =
        (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    let mut carriers = BTreeSet::new();
    for _ in 0..2000 {
        let m = message().new_tree(&mut runner).unwrap().current();
        messages.insert(message_variant(&m));
        let error = match &m {
            Message::InitAck { result: Err(e) }
            | Message::TaskResult {
                outcome: Err(e), ..
            }
            | Message::EventAck { result: Err(e), .. } => Some(e),
            _ => None,
        };
        if let Some(e) = error {
            classes.insert(class_index(e.class));
        }
        let shareable = match &m {
            Message::Execute(e) => Some(&e.input),
            Message::TaskResult { outcome: Ok(o), .. } => Some(&o.output),
            _ => None,
        };
        for b in shareable.into_iter().flat_map(|s| &s.blobs) {
            carriers.insert(matches!(b.carrier, Carrier::Inline));
        }
        let h = handshake().new_tree(&mut runner).unwrap().current();
        handshakes.insert(handshake_variant(&h));
    }
    assert_eq!(messages.len(), 15, "{messages:?}");
    assert_eq!(handshakes.len(), 4, "{handshakes:?}");
    assert_eq!(classes.len(), ALL_CLASSES.len(), "{classes:?}");
    assert_eq!(carriers.len(), 2, "inline and fd carriers");
}

#[test]
fn every_error_class_round_trips_in_every_error_position() {
    for class in ALL_CLASSES {
        let e = RankError {
            class,
            message: class.as_str().to_owned(),
        };
        for m in [
            Message::InitAck {
                result: Err(e.clone()),
            },
            Message::TaskResult {
                task_id: 7,
                outcome: Err(e.clone()),
            },
            Message::EventAck {
                event_id: 7,
                result: Err(e.clone()),
            },
        ] {
            let bytes = codec::encode(&m).unwrap();
            assert_eq!(codec::decode::<Message>(&bytes).unwrap(), m);
        }
    }
}

#[test]
fn frames_read_back_to_back() {
    // Several frames on one connection are read one at a time, without bleeding into
    // each other.
    let (a, b) = Conn::pair().unwrap();
    let msgs = [
        Message::Heartbeat { seq: 1 },
        Message::Close {
            reason: "x".to_owned(),
        },
    ];
    for m in &msgs {
        envelope::frame(m, vec![Bytes::from_static(b"body")], vec![])
            .unwrap()
            .write_to(&a)
            .unwrap();
    }
    drop(a);
    for m in &msgs {
        let got = read_frame(&b, &FrameLimits::for_max_frame(1 << 20)).unwrap();
        assert_eq!(&envelope::decode(&got).unwrap(), m);
        assert_eq!(&got.body[..], b"body");
    }
    let mut rest = Vec::new();
    (&b).read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}
