//! Messages with blobs: packing a [`Shareable`] into a frame and unpacking it again.
//!
//! A blob travels one of two ways ([`Carrier`]):
//! - **inline**: its bytes follow the header in the frame body;
//! - **as a sealed memory file** (local connections only): blobs of at least
//!   [`BlobPolicy::zero_copy_threshold`] bytes are written once into a sealed `memfd`
//!   and the descriptor is passed with the frame. Every rank maps the same pages, so
//!   fanning a 1 GiB model out to 8 ranks costs one copy, not eight. A blob that already
//!   lives in a sealed memory file (say, a rank's result being forwarded) is passed
//!   again without any copy.
//!
//! Packing checks the metadata against the receiver's bound ([`check_map`]) so that a
//! value nested too deep fails here, with its path, instead of breaking the connection.
//!
//! Unpacking checks that the inline lengths add up to the body exactly and that every
//! descriptor is used exactly once; anything else is a protocol violation.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use bytes::Bytes;

use super::codec::{self, CodecError};
use super::frame::{InFrame, OutFrame};
use super::message::{BlobHeader, Carrier, Message, WireShareable};
use crate::os::{self, ShmError};
use crate::shareable::{Blob, Shareable};
use crate::value::{ValueError, check_map};

/// How blobs are carried in frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobPolicy {
    /// Blobs at least this large go as sealed memory files when descriptors can be passed.
    pub zero_copy_threshold: u64,
    /// Whether the connection can pass descriptors.
    pub pass_fds: bool,
}

impl BlobPolicy {
    /// Everything inline (TCP connections).
    pub const INLINE: BlobPolicy = BlobPolicy {
        zero_copy_threshold: u64::MAX,
        pass_fds: false,
    };
}

/// Why a shareable could not be packed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// A memory file could not be created or written.
    #[error("cannot place blob `{name}` in shared memory")]
    Shm {
        /// The blob.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Too many blobs would travel as descriptors in one frame.
    #[error("{count} shared blobs exceed the limit of {max} per frame")]
    TooManyShared {
        /// How many.
        count: usize,
        /// The limit.
        max: u32,
    },
    /// The header could not be encoded.
    #[error("cannot encode the message")]
    Codec(#[from] CodecError),
    /// A metadata value or property is beyond what the peer decodes.
    #[error(transparent)]
    Value(#[from] ValueError),
}

/// Why a received shareable was refused.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// Inline lengths do not add up to the body.
    #[error("inline blobs declare {declared} bytes but the frame body has {body}")]
    InlineMismatch {
        /// Sum of inline lengths.
        declared: u64,
        /// Body length.
        body: u64,
    },
    /// A blob names a descriptor that is not there.
    #[error("blob `{name}` names file descriptor {index} of {count}")]
    FdIndex {
        /// The blob.
        name: String,
        /// The index.
        index: u32,
        /// How many arrived.
        count: usize,
    },
    /// Two blobs name the same descriptor.
    #[error("file descriptor {index} is used by two blobs")]
    FdReused {
        /// The index.
        index: u32,
    },
    /// Descriptors arrived that no blob uses.
    #[error("{count} file descriptors arrived that no blob uses")]
    FdUnused {
        /// How many.
        count: usize,
    },
    /// Two blobs share a name.
    #[error("blob `{0}` appears twice")]
    DuplicateName(String),
    /// A passed memory file was refused.
    #[error("blob `{name}`")]
    Shm {
        /// The blob.
        name: String,
        /// Why.
        #[source]
        source: ShmError,
    },
    /// The frame carries a body or descriptors that its message does not describe.
    #[error("message {kind} carries {body} body bytes and {fds} descriptors it does not describe")]
    Unexpected {
        /// The message kind.
        kind: &'static str,
        /// Body length.
        body: u64,
        /// Descriptor count.
        fds: usize,
    },
}

/// Describes `shareable`'s blobs, appending their bytes to `body` and their memory
/// files to `fds`.
pub fn pack(
    shareable: &Shareable,
    policy: BlobPolicy,
    body: &mut Vec<Bytes>,
    fds: &mut Vec<Arc<OwnedFd>>,
) -> Result<WireShareable, PackError> {
    check_map("meta", shareable.meta_map())?;
    let mut blobs = Vec::with_capacity(shareable.blobs().len());
    for (name, blob) in shareable.blobs() {
        let len = blob.len() as u64;
        let shared = policy.pass_fds && (blob.is_shared() || len >= policy.zero_copy_threshold);
        let carrier = if shared {
            let fd = match blob.memfd() {
                Some(fd) => fd.clone(),
                None => Arc::new(os::sealed_memfd(&memfd_name(name), &[blob]).map_err(
                    |source| PackError::Shm {
                        name: name.clone(),
                        source,
                    },
                )?),
            };
            fds.push(fd);
            let index = fds.len() - 1;
            if index >= super::frame::MAX_FDS_PER_FRAME as usize {
                return Err(PackError::TooManyShared {
                    count: fds.len(),
                    max: super::frame::MAX_FDS_PER_FRAME,
                });
            }
            Carrier::Fd(index as u32)
        } else {
            body.push(blob.bytes().clone());
            Carrier::Inline
        };
        blobs.push(BlobHeader {
            name: name.clone(),
            len,
            carrier,
        });
    }
    Ok(WireShareable {
        meta: shareable.meta_map().clone(),
        blobs,
    })
}

/// Checks context properties against the receiver's bound (named `props.KEY`).
pub fn check_props(props: &super::message::Props) -> Result<(), ValueError> {
    check_map("props", props.iter().map(|(k, p)| (k, &p.value)))
}

/// The longest memory-file name [`memfd_name`] produces, in bytes (the kernel's limit
/// is 249).
const MEMFD_NAME_MAX: usize = 200;

/// The name of a blob's memory file. It is only a label (`/proc/PID/fd` shows
/// `memfd:NAME`), but `memfd_create` refuses a name with a NUL byte or longer than 249
/// bytes, while a blob name may be any string: NULs become `_` and the name is cut at a
/// character boundary.
fn memfd_name(blob: &str) -> String {
    let mut name = String::with_capacity(blob.len().min(MEMFD_NAME_MAX));
    for c in blob.chars().map(|c| if c == '\0' { '_' } else { c }) {
        if name.len() + c.len_utf8() > MEMFD_NAME_MAX {
            break;
        }
        name.push(c);
    }
    name
}

/// Rebuilds a shareable from its description, the frame body and the passed files.
pub fn unpack(
    wire: WireShareable,
    body: &Bytes,
    fds: Vec<OwnedFd>,
) -> Result<Shareable, UnpackError> {
    let declared: u64 = wire
        .blobs
        .iter()
        .filter(|b| b.carrier == Carrier::Inline)
        .map(|b| b.len)
        .fold(0u64, u64::saturating_add);
    if declared != body.len() as u64 {
        return Err(UnpackError::InlineMismatch {
            declared,
            body: body.len() as u64,
        });
    }
    let count = fds.len();
    let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
    let mut offset = 0usize;
    let mut blobs = BTreeMap::new();
    for h in wire.blobs {
        let blob = match h.carrier {
            Carrier::Inline => {
                // `declared == body.len()` bounds every slice.
                let end = offset + h.len as usize;
                let b = Blob::new(body.slice(offset..end));
                offset = end;
                b
            }
            Carrier::Fd(index) => {
                let slot = fds.get_mut(index as usize).ok_or(UnpackError::FdIndex {
                    name: h.name.clone(),
                    index,
                    count,
                })?;
                let fd = slot.take().ok_or(UnpackError::FdReused { index })?;
                let (bytes, fd) = os::map_sealed(fd, h.len).map_err(|source| UnpackError::Shm {
                    name: h.name.clone(),
                    source,
                })?;
                Blob::from_sealed_memfd(bytes, fd)
            }
        };
        if blobs.insert(h.name.clone(), blob).is_some() {
            return Err(UnpackError::DuplicateName(h.name));
        }
    }
    let unused = fds.iter().filter(|f| f.is_some()).count();
    if unused > 0 {
        return Err(UnpackError::FdUnused { count: unused });
    }
    Ok(Shareable::from_parts(wire.meta, blobs))
}

/// Encodes a message into a frame with the given body and files.
pub fn frame(
    msg: &Message,
    body: Vec<Bytes>,
    fds: Vec<Arc<OwnedFd>>,
) -> Result<OutFrame, CodecError> {
    Ok(OutFrame::new(&codec::encode(msg)?, body, fds))
}

/// Encodes a message that carries no blobs.
pub fn plain(msg: &Message) -> Result<OutFrame, CodecError> {
    frame(msg, Vec::new(), Vec::new())
}

/// Decodes a frame's message. The caller unpacks any shareable it describes with
/// [`unpack`], or checks with [`expect_plain`] that there is nothing else.
pub fn decode(frame: &InFrame) -> Result<Message, CodecError> {
    codec::decode(&frame.header)
}

/// Refuses a body or descriptors on a message that describes no blobs.
pub fn expect_plain(kind: &'static str, frame: &InFrame) -> Result<(), UnpackError> {
    if frame.body.is_empty() && frame.fds.is_empty() {
        Ok(())
    } else {
        Err(UnpackError::Unexpected {
            kind,
            body: frame.body.len() as u64,
            fds: frame.fds.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Shareable {
        Shareable::new()
            .with_meta("k", 1)
            .with_blob("small", vec![1u8; 10])
            .with_blob("big", vec![2u8; 100])
    }

    #[test]
    fn small_blobs_go_inline_and_big_ones_shared() {
        let policy = BlobPolicy {
            zero_copy_threshold: 50,
            pass_fds: true,
        };
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let wire = pack(&sample(), policy, &mut body, &mut fds).unwrap();
        assert_eq!(fds.len(), 1);
        let body: Bytes = body.concat().into();
        let fds: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        let back = unpack(wire, &body, fds).unwrap();
        assert_eq!(back, sample());
        assert!(back.blob("big").unwrap().is_shared());
        assert!(!back.blob("small").unwrap().is_shared());
    }

    #[test]
    fn shared_blobs_are_forwarded_without_a_new_file() {
        let policy = BlobPolicy {
            zero_copy_threshold: 50,
            pass_fds: true,
        };
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let wire = pack(&sample(), policy, &mut body, &mut fds).unwrap();
        let body: Bytes = body.concat().into();
        let owned: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        let received = unpack(wire, &body, owned).unwrap();
        let original = received.blob("big").unwrap().memfd().unwrap().clone();
        let (mut body2, mut fds2) = (Vec::new(), Vec::new());
        pack(&received, policy, &mut body2, &mut fds2).unwrap();
        assert!(
            Arc::ptr_eq(&fds2[0], &original),
            "the same memory file is passed on"
        );
    }

    #[test]
    fn any_blob_name_can_be_shared() {
        // memfd_create refuses NUL bytes and names over 249 bytes; blob names are free.
        let policy = BlobPolicy {
            zero_copy_threshold: 1,
            pass_fds: true,
        };
        let s = Shareable::new()
            .with_blob("nul\0inside", vec![1u8; 4])
            .with_blob("x".repeat(250), vec![2u8; 4])
            .with_blob("é".repeat(300), vec![3u8; 4]);
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let wire = pack(&s, policy, &mut body, &mut fds).unwrap();
        assert_eq!(fds.len(), 3);
        let fds: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        assert_eq!(unpack(wire, &Bytes::new(), fds).unwrap(), s);
        assert_eq!(memfd_name("a\0b"), "a_b");
        assert_eq!(memfd_name(&"é".repeat(300)).len(), MEMFD_NAME_MAX);
    }

    #[test]
    fn oversized_headers_are_refused_by_the_sender() {
        let msg = Message::InitAck {
            result: Err(super::super::message::RankError {
                class: crate::ErrorClass::Exception,
                message: "x".repeat(codec::MAX_HEADER_BYTES + 1),
            }),
        };
        let err = plain(&msg).unwrap_err();
        assert!(matches!(err, CodecError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn inline_mismatch_and_bad_fd_indexes_are_refused() {
        let wire = WireShareable {
            meta: Default::default(),
            blobs: vec![BlobHeader {
                name: "a".into(),
                len: 5,
                carrier: Carrier::Inline,
            }],
        };
        let err = unpack(wire, &Bytes::from_static(b"abc"), vec![]).unwrap_err();
        assert!(matches!(
            err,
            UnpackError::InlineMismatch {
                declared: 5,
                body: 3
            }
        ));
        let wire = WireShareable {
            meta: Default::default(),
            blobs: vec![BlobHeader {
                name: "a".into(),
                len: 5,
                carrier: Carrier::Fd(3),
            }],
        };
        let err = unpack(wire, &Bytes::new(), vec![]).unwrap_err();
        assert!(matches!(err, UnpackError::FdIndex { index: 3, .. }));
    }
}
