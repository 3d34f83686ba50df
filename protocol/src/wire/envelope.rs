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
    /// A blob's offset in its memory file is not a multiple of the page size.
    #[error("blob `{name}` starts at offset {offset} of its memory file, not at a page boundary")]
    Misaligned {
        /// The blob.
        name: String,
        /// The offset.
        offset: u64,
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
///
/// Every blob that must be copied into shared memory goes into one memory file (each
/// at a page-aligned offset), and a memory file already in `fds` is passed once however
/// many blobs live in it: a model of hundreds of tensors passes a handful of
/// descriptors, never more than [`MAX_FDS_PER_FRAME`](super::frame::MAX_FDS_PER_FRAME).
/// The new file is admitted against the host's available memory first
/// ([`NoMemory`](crate::NoMemory), inside [`PackError::Shm`]).
pub fn pack(
    shareable: &Shareable,
    policy: BlobPolicy,
    body: &mut Vec<Bytes>,
    fds: &mut Vec<Arc<OwnedFd>>,
) -> Result<WireShareable, PackError> {
    check_map("meta", shareable.meta_map())?;
    let shared = |blob: &Blob| {
        policy.pass_fds && (blob.is_shared() || blob.len() as u64 >= policy.zero_copy_threshold)
    };
    // The blobs to copy, with their offsets in one new file.
    let mut arena: Vec<(&[u8], u64)> = Vec::new();
    let mut arena_len = 0u64;
    let mut first = None;
    for (name, blob) in shareable.blobs() {
        if shared(blob) && blob.memfd().is_none() {
            let offset = os::page_align(arena_len);
            arena.push((blob, offset));
            arena_len = offset + blob.len() as u64;
            first.get_or_insert(name.as_str());
        }
    }
    let arena_fd = match first {
        None => None,
        Some(first) => {
            let len = usize::try_from(arena_len).map_err(|_| PackError::Shm {
                name: first.to_owned(),
                source: std::io::Error::other("blobs larger than the address space"),
            })?;
            let label = memfd_name(&format!("{first}+{}", arena.len() - 1));
            // Written with `pwrite`, not through a mapping: see `os::sealed_memfd_at`.
            let placed: Vec<(u64, &[u8])> = arena.iter().map(|(b, at)| (*at, *b)).collect();
            let fd = os::sealed_memfd_at(&label, len as u64, &placed).map_err(|source| {
                PackError::Shm {
                    name: first.to_owned(),
                    source,
                }
            })?;
            Some(Arc::new(fd))
        }
    };
    let mut next = 0usize; // the next arena slot, in blob order
    let mut blobs = Vec::with_capacity(shareable.blobs().len());
    for (name, blob) in shareable.blobs() {
        let len = blob.len() as u64;
        let carrier = if shared(blob) {
            let (fd, offset) = match (blob.memfd(), &arena_fd) {
                (Some(fd), _) => (fd, blob.memfd_offset()),
                (None, Some(fd)) => {
                    let offset = arena[next].1;
                    next += 1;
                    (fd, offset)
                }
                // Every shared blob without a file has a slot in the arena above.
                (None, None) => unreachable!("a blob to copy without a memory file"),
            };
            // One descriptor per file: the same `Arc`, or another descriptor of the
            // same file (blobs a process received one by one, say over Flower's
            // channel, each with its own duplicate).
            let index = match fds
                .iter()
                .position(|f| Arc::ptr_eq(f, fd) || os::same_file(f, fd))
            {
                Some(i) => i,
                None => {
                    fds.push(fd.clone());
                    fds.len() - 1
                }
            };
            if index >= super::frame::MAX_FDS_PER_FRAME as usize {
                return Err(PackError::TooManyShared {
                    count: fds.len(),
                    max: super::frame::MAX_FDS_PER_FRAME,
                });
            }
            let index = index as u32;
            if offset == 0 {
                Carrier::Fd(index)
            } else {
                Carrier::FdAt { index, offset }
            }
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
///
/// Each file is checked (sealed, long enough for every blob in it) and mapped once;
/// its blobs are slices of that one mapping. A blob's offset must be a multiple of
/// the page size (so that a rank can map it copy-on-write on its own).
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
    // How far into each file its blobs reach.
    let count = fds.len();
    let mut extent: Vec<Option<u64>> = vec![None; count];
    for h in &wire.blobs {
        let Some((index, offset)) = h.carrier.file() else {
            continue;
        };
        let slot = extent
            .get_mut(index as usize)
            .ok_or_else(|| UnpackError::FdIndex {
                name: h.name.clone(),
                index,
                count,
            })?;
        if offset != os::page_align(offset) {
            return Err(UnpackError::Misaligned {
                name: h.name.clone(),
                offset,
            });
        }
        let end = offset.checked_add(h.len).ok_or_else(|| UnpackError::Shm {
            name: h.name.clone(),
            source: ShmError::TooShort {
                actual: 0,
                declared: u64::MAX,
            },
        })?;
        *slot = Some(slot.unwrap_or(0).max(end));
    }
    let unused = extent.iter().filter(|e| e.is_none()).count();
    if unused > 0 {
        return Err(UnpackError::FdUnused { count: unused });
    }
    let mut maps: Vec<(Bytes, Arc<OwnedFd>)> = Vec::with_capacity(count);
    for (fd, end) in fds.into_iter().zip(extent) {
        let end = end.unwrap_or(0);
        let mapped = os::map_sealed(fd, end).map_err(|source| UnpackError::Shm {
            name: first_blob_in(&wire.blobs, maps.len() as u32),
            source,
        })?;
        maps.push(mapped);
    }
    let mut offset = 0usize;
    let mut blobs = BTreeMap::new();
    for h in wire.blobs {
        let blob = match h.carrier.file() {
            None => {
                // `declared == body.len()` bounds every slice.
                let end = offset + h.len as usize;
                let b = Blob::new(body.slice(offset..end));
                offset = end;
                b
            }
            Some((index, at)) => {
                // Checked above: the index is in range and `at + len` within the mapping.
                let (bytes, fd) = &maps[index as usize];
                let (start, end) = (at as usize, (at + h.len) as usize);
                Blob::from_sealed_memfd_at(bytes.slice(start..end), fd.clone(), at)
            }
        };
        if blobs.insert(h.name.clone(), blob).is_some() {
            return Err(UnpackError::DuplicateName(h.name));
        }
    }
    Ok(Shareable::from_parts(wire.meta, blobs))
}

/// The first blob carried in file `index` (for naming a refused file).
fn first_blob_in(blobs: &[BlobHeader], index: u32) -> String {
    blobs
        .iter()
        .find(|b| b.carrier.file().is_some_and(|(i, _)| i == index))
        .map(|b| b.name.clone())
        .unwrap_or_default()
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
        assert_eq!(fds.len(), 1, "the three blobs share one memory file");
        let fds: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        assert_eq!(unpack(wire, &Bytes::new(), fds).unwrap(), s);
        assert_eq!(memfd_name("a\0b"), "a_b");
        assert_eq!(memfd_name(&"é".repeat(300)).len(), MEMFD_NAME_MAX);
    }

    #[test]
    fn hundreds_of_blobs_share_one_file_at_page_aligned_offsets() {
        // A transformer's state dict: far more tensors than descriptors per frame.
        let policy = BlobPolicy {
            zero_copy_threshold: 64,
            pass_fds: true,
        };
        let mut s = Shareable::new();
        for i in 0..300u32 {
            s.set_blob(
                format!("h.{i}.weight"),
                vec![(i % 251) as u8; 100 + i as usize],
            );
        }
        let (mut body, mut fds) = (Vec::new(), Vec::new());
        let wire = pack(&s, policy, &mut body, &mut fds).unwrap();
        assert_eq!(fds.len(), 1);
        for h in &wire.blobs {
            let (index, offset) = h.carrier.file().unwrap();
            assert_eq!(index, 0);
            assert_eq!(offset % os::page_align(1), 0, "{} at {offset}", h.name);
        }
        let owned: Vec<OwnedFd> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
        let received = unpack(wire, &Bytes::new(), owned).unwrap();
        assert_eq!(received, s);
        // Forwarding passes the one file again, each blob at its offset.
        let (mut body2, mut fds2) = (Vec::new(), Vec::new());
        let wire2 = pack(&received, policy, &mut body2, &mut fds2).unwrap();
        assert_eq!(fds2.len(), 1);
        assert!(Arc::ptr_eq(
            &fds2[0],
            received.blob("h.7.weight").unwrap().memfd().unwrap()
        ));
        let owned: Vec<OwnedFd> = fds2.iter().map(|f| f.try_clone().unwrap()).collect();
        assert_eq!(unpack(wire2, &Bytes::new(), owned).unwrap(), s);
    }

    #[test]
    fn misaligned_and_overlong_blobs_in_a_file_are_refused() {
        let fd = || os::sealed_memfd("t", &[&[7u8; 100]]).unwrap();
        let wire = |len, offset| WireShareable {
            meta: Default::default(),
            blobs: vec![BlobHeader {
                name: "w".into(),
                len,
                carrier: Carrier::FdAt { index: 0, offset },
            }],
        };
        let err = unpack(wire(10, 12), &Bytes::new(), vec![fd()]).unwrap_err();
        assert!(
            matches!(err, UnpackError::Misaligned { offset: 12, .. }),
            "{err}"
        );
        let page = os::page_align(1);
        let err = unpack(wire(10, page), &Bytes::new(), vec![fd()]).unwrap_err();
        assert!(
            matches!(
                err,
                UnpackError::Shm {
                    source: ShmError::TooShort { .. },
                    ..
                }
            ),
            "{err}"
        );
        let err = unpack(wire(10, u64::MAX - page + 1), &Bytes::new(), vec![fd()]).unwrap_err();
        assert!(matches!(err, UnpackError::Shm { .. }), "{err}");
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
