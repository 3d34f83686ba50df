//! Replays the `cargo fuzz` regression corpus on stable.
//!
//! The fuzzer (`fuzz/`, nightly only) keeps the inputs that reached new code, and any
//! input that once crashed, in `fuzz/corpus/frame_decoder`. Running them here through the
//! same entry point keeps every fixed crash fixed without needing nightly or libFuzzer.

use std::path::PathBuf;

use rankexec_protocol::fuzzing::decode_frame;

#[test]
fn every_corpus_input_decodes_without_panicking() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/frame_decoder");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no corpus files in {}", dir.display());
    for path in &files {
        let data = std::fs::read(path).unwrap();
        decode_frame(&data);
    }
}

#[test]
fn inputs_larger_than_the_socket_buffer_do_not_deadlock() {
    // A valid prefix that declares a body larger than any socket buffer, followed by
    // that body: the reader consumes it while the writer thread sends.
    let body = 3usize << 18;
    let mut data = Vec::with_capacity(20 + body);
    data.extend_from_slice(b"RXF1");
    data.extend_from_slice(&0u32.to_le_bytes());
    data.extend_from_slice(&(body as u64).to_le_bytes());
    data.extend_from_slice(&0u32.to_le_bytes());
    data.resize(20 + body, 7);
    decode_frame(&data);
    // The same bytes behind a bad magic: the reader stops at once and the blocked
    // writer must still be released.
    data[0] = b'X';
    decode_frame(&data);
    // Longer than the input cap.
    decode_frame(&vec![0u8; (1 << 20) + 10]);
}
