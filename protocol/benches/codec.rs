//! Micro-benchmarks of the codec and the framing: `cargo bench -p rankexec-protocol`.
//!
//! They measure what every task pays on the wire besides the payload: encoding and
//! decoding an `Execute` header, and a frame's trip through a local socket pair, with an
//! inline body and with a body passed as a sealed memory file.

use std::collections::BTreeMap;

use bytes::Bytes;
use rankexec_protocol::wire::envelope::{self, BlobPolicy};
use rankexec_protocol::wire::message::{Execute, Message, Props};
use rankexec_protocol::wire::{Conn, FrameLimits, codec, frame};
use rankexec_protocol::{Prop, Shareable, Value};

fn main() {
    divan::main();
}

fn execute_message() -> Message {
    let mut props = Props::new();
    for i in 0..8 {
        props.insert(
            format!("prop_{i}"),
            Prop {
                value: Value::from(i as i64),
                private: i % 2 == 0,
                sticky: false,
            },
        );
    }
    let mut meta = BTreeMap::new();
    meta.insert("round".to_owned(), Value::Int(3));
    meta.insert("lr".to_owned(), Value::Float(0.01));
    Message::Execute(Box::new(Execute {
        task_id: 42,
        task: "train".into(),
        props,
        input: rankexec_protocol::wire::message::WireShareable {
            meta,
            blobs: Vec::new(),
        },
        want_output: false,
    }))
}

#[divan::bench]
fn encode_execute_header(b: divan::Bencher) {
    let m = execute_message();
    b.bench(|| codec::encode(divan::black_box(&m)));
}

#[divan::bench]
fn decode_execute_header(b: divan::Bencher) {
    let bytes = codec::encode(&execute_message()).unwrap();
    b.bench(|| codec::decode::<Message>(divan::black_box(&bytes)));
}

#[divan::bench(args = [0, 1024, 1 << 20])]
fn frame_round_trip_inline(b: divan::Bencher, size: usize) {
    let (a, z) = Conn::pair().unwrap();
    let body = Bytes::from(vec![1u8; size]);
    let header = codec::encode(&execute_message()).unwrap();
    let limits = FrameLimits::for_max_frame(1 << 30);
    b.bench(|| {
        let f = frame::OutFrame::new(&header, vec![body.clone()], Vec::new());
        // Write from another thread so a body larger than the socket buffer cannot block.
        std::thread::scope(|s| {
            s.spawn(|| f.write_to(&a).unwrap());
            frame::read_frame(&z, &limits).unwrap()
        })
    });
}

#[divan::bench(args = [1 << 20, 64 << 20])]
fn pack_shared_blob(b: divan::Bencher, size: usize) {
    let data = Bytes::from(vec![3u8; size]);
    let policy = BlobPolicy {
        zero_copy_threshold: 64 << 10,
        pass_fds: true,
    };
    b.bench(|| {
        let s = Shareable::new().with_blob("m", data.clone());
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        envelope::pack(&s, policy, &mut body, &mut fds).unwrap()
    });
}
