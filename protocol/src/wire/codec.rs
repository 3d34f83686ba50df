//! The header codec: the one module that knows about bincode.
//!
//! Headers are encoded with serde and bincode 2.0.1 (`standard()` configuration:
//! little-endian, varint lengths). Decoding is bounded by [`MAX_HEADER_BYTES`], which
//! also caps the length that any decoded container may claim, so a hostile length
//! prefix cannot trigger a huge allocation. Large data never passes through here: blob
//! bytes are written raw after the header (see [`frame`](super::frame)).
//!
//! Swapping the codec touches this file only.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest header, in bytes, that this codec will decode.
pub const MAX_HEADER_BYTES: usize = 64 << 20;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a header could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// Encoding failed.
    #[error("failed to encode header")]
    Encode(#[source] BoxError),
    /// The bytes are not a valid header.
    #[error("malformed header")]
    Decode(#[source] BoxError),
    /// The encoded header is over [`MAX_HEADER_BYTES`]: no reader would accept it.
    #[error("header of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The encoded length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The header decoded but bytes were left over.
    #[error("header has {extra} trailing bytes")]
    Trailing {
        /// How many bytes were left.
        extra: usize,
    },
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_HEADER_BYTES>()
}

/// Encodes a value.
///
/// A header over [`MAX_HEADER_BYTES`] is refused here, on the sending side, so its
/// length never wraps the frame's `u32` field and no receiver has to refuse it.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    let bytes = bincode::serde::encode_to_vec(value, config())
        .map_err(|e| CodecError::Encode(Box::new(e)))?;
    if bytes.len() > MAX_HEADER_BYTES {
        return Err(CodecError::TooLarge {
            len: bytes.len(),
            max: MAX_HEADER_BYTES,
        });
    }
    Ok(bytes)
}

/// Decodes a value that must use every byte of `bytes`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    let (value, used) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| CodecError::Decode(Box::new(e)))?;
    if used != bytes.len() {
        return Err(CodecError::Trailing {
            extra: bytes.len() - used,
        });
    }
    Ok(value)
}
