//! The record layer's cipher beside the alternative: `cargo bench -p rankexec-protocol
//! --bench cipher`.
//!
//! Encrypted TCP seals every record of at most 64 KiB (`wire::secure::MAX_RECORD`) with
//! ChaCha20-Poly1305 and opens it on the other side. This measures sealing and opening
//! one such record on one core with ChaCha20-Poly1305 (the wire's) and with
//! AES-256-GCM (RustCrypto's `aes-gcm`, which uses AES-NI and PCLMULQDQ where the CPU has
//! them), so that BENCHMARKS.md can say which is faster on the machine at hand.

use aes_gcm::Aes256Gcm;
use chacha20poly1305::ChaCha20Poly1305;
use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use divan::counter::BytesCount;

const RECORD: usize = 64 << 10;

fn main() {
    divan::main();
}

fn seal_open<C: AeadInPlace + KeyInit>(bencher: divan::Bencher, open: bool) {
    let cipher = C::new_from_slice(&[7u8; 32]).unwrap_or_else(|_| unreachable!());
    let nonce = Default::default();
    let mut buf = vec![0x5au8; RECORD];
    let tag = cipher
        .encrypt_in_place_detached(&nonce, b"", &mut buf)
        .unwrap_or_else(|_| unreachable!());
    bencher.counter(BytesCount::new(RECORD)).bench_local(|| {
        let mut copy = buf.clone();
        let done = if open {
            cipher.decrypt_in_place_detached(&nonce, b"", &mut copy, &tag)
        } else {
            cipher
                .encrypt_in_place_detached(&nonce, b"", &mut copy)
                .map(drop)
        };
        done.unwrap_or_else(|_| unreachable!());
        copy
    });
}

/// Seal one 64 KiB record with ChaCha20-Poly1305 (the wire's cipher).
#[divan::bench]
fn seal_chacha20poly1305(bencher: divan::Bencher) {
    seal_open::<ChaCha20Poly1305>(bencher, false);
}

/// Seal one 64 KiB record with AES-256-GCM.
#[divan::bench]
fn seal_aes256gcm(bencher: divan::Bencher) {
    seal_open::<Aes256Gcm>(bencher, false);
}

/// Open one 64 KiB record with ChaCha20-Poly1305.
#[divan::bench]
fn open_chacha20poly1305(bencher: divan::Bencher) {
    seal_open::<ChaCha20Poly1305>(bencher, true);
}

/// Open one 64 KiB record with AES-256-GCM.
#[divan::bench]
fn open_aes256gcm(bencher: divan::Bencher) {
    seal_open::<Aes256Gcm>(bencher, true);
}

/// Copy one 64 KiB record (the clone each measurement above includes).
#[divan::bench]
fn copy_only(bencher: divan::Bencher) {
    let buf = vec![0x5au8; RECORD];
    bencher
        .counter(BytesCount::new(RECORD))
        .bench_local(|| buf.clone());
}
