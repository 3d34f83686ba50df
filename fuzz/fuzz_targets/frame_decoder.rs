//! Fuzzes the frame reader and the header decoders with arbitrary byte streams.
//!
//! Everything a peer sends, authenticated or not, reaches `read_frame`, the header
//! codec and `envelope::unpack`; this target checks that no input makes them panic,
//! hang or exhaust memory. The logic lives in `rankexec_protocol::fuzzing` so that the
//! corpus can be replayed on stable (`protocol/tests/fuzz_corpus.rs`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rankexec_protocol::fuzzing::decode_frame(data);
});
