//! The digits data, embedded in the crate as `examples/data/digits.bin`.
//!
//! The examples used to load the set through `smartcore`'s `datasets` feature, which
//! pulled a numeric stack (`num`, `rand`, `typetag`, ...) into every binary that
//! registers the example trainers, the `rankexec` CLI included. The data is now a
//! 117 KB file of raw pixel counts, parsed here with checks; nothing is downloaded.
//! See `examples/data/README.md` for its origin (UCI optical digits, CC BY 4.0) and
//! layout. Caveat: the file was generated once from smartcore 0.7's loader; the tests
//! below pin facts about it (taken from scikit-learn's `load_digits`, the same set) so
//! that a wrong or damaged file fails them.

use crate::digits::{Data, FEATURES};

/// The embedded file.
pub const DIGITS_BIN: &[u8] = include_bytes!("../data/digits.bin");

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"RXDIGITS";

/// Magic, sample count (u32 LE), feature count (u32 LE).
const HEADER: usize = 16;

/// The largest pixel count: each feature counts the set pixels of a 4x4 block.
pub const MAX_PIXEL: u8 = 16;

/// Why the digits file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// Shorter than its header.
    #[error("the digits file is {len} bytes, shorter than its {HEADER}-byte header")]
    Truncated {
        /// Bytes in the file.
        len: usize,
    },
    /// Not a digits file.
    #[error("the digits file does not start with \"RXDIGITS\"")]
    Magic,
    /// A feature count other than 64.
    #[error("the digits file has {features} features per sample, expected {FEATURES}")]
    Features {
        /// Features the header declares.
        features: u32,
    },
    /// No samples.
    #[error("the digits file has no samples")]
    Empty,
    /// A length that does not match the header.
    #[error("the digits file is {len} bytes, its header promises {expected}")]
    Length {
        /// Bytes in the file.
        len: usize,
        /// Bytes the header promises.
        expected: usize,
    },
    /// A pixel count above 16.
    #[error("sample {sample} has pixel count {value} at feature {feature}, above {MAX_PIXEL}")]
    Pixel {
        /// The sample (0-based).
        sample: usize,
        /// The feature (0-based).
        feature: usize,
        /// The value found.
        value: u8,
    },
    /// A label that is not a digit.
    #[error("sample {sample} has label {label}, not a digit")]
    Label {
        /// The sample (0-based).
        sample: usize,
        /// The value found.
        label: u8,
    },
}

/// Parses a digits file: `RXDIGITS`, samples `n` (u32 LE), features (u32 LE, 64), then
/// `n x 64` pixel counts (one byte each, 0..=16, row-major), then `n` labels (one byte
/// each, 0..=9). Features are scaled to [0, 1] (count / 16).
pub fn parse(bytes: &[u8]) -> Result<Data, DataError> {
    let header = bytes
        .get(..HEADER)
        .ok_or(DataError::Truncated { len: bytes.len() })?;
    let (magic, rest) = header.split_at(MAGIC.len());
    if magic != MAGIC {
        return Err(DataError::Magic);
    }
    let (n, features) = rest.split_at(4);
    let word = |b: &[u8]| -> u32 {
        let mut w = [0u8; 4];
        w.copy_from_slice(b);
        u32::from_le_bytes(w)
    };
    let (n, features) = (word(n) as usize, word(features));
    if features as usize != FEATURES {
        return Err(DataError::Features { features });
    }
    if n == 0 {
        return Err(DataError::Empty);
    }
    // n < 2^32 and FEATURES + 1 = 65: no overflow on 64-bit targets; checked anyway.
    let expected = n
        .checked_mul(FEATURES + 1)
        .and_then(|b| b.checked_add(HEADER))
        .ok_or(DataError::Length {
            len: bytes.len(),
            expected: usize::MAX,
        })?;
    if bytes.len() != expected {
        return Err(DataError::Length {
            len: bytes.len(),
            expected,
        });
    }
    let (pixels, labels) = bytes[HEADER..].split_at(n * FEATURES);
    let mut x = Vec::with_capacity(pixels.len());
    for (i, &value) in pixels.iter().enumerate() {
        if value > MAX_PIXEL {
            return Err(DataError::Pixel {
                sample: i / FEATURES,
                feature: i % FEATURES,
                value,
            });
        }
        x.push(f32::from(value) / f32::from(MAX_PIXEL));
    }
    if let Some((sample, &label)) = labels.iter().enumerate().find(|(_, l)| **l > 9) {
        return Err(DataError::Label { sample, label });
    }
    Ok(Data {
        x,
        y: labels.to_vec(),
    })
}

/// The embedded digits set, parsed.
pub fn digits() -> Result<Data, DataError> {
    parse(DIGITS_BIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a, 64 bits.
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    fn counts(d: &Data, i: usize) -> Vec<u8> {
        d.x[i * FEATURES..(i + 1) * FEATURES]
            .iter()
            .map(|v| (v * 16.0) as u8)
            .collect()
    }

    // The facts below are scikit-learn 1.x's `load_digits()` (the same UCI set).
    #[test]
    fn the_embedded_file_is_the_digits_set() {
        let d = digits().unwrap();
        assert_eq!(d.len(), 1797);
        assert_eq!(d.x.len(), 1797 * FEATURES);
        let mut per_class = [0usize; 10];
        for y in &d.y {
            per_class[*y as usize] += 1;
        }
        assert_eq!(
            per_class,
            [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
        );
        assert_eq!(&d.y[..12], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]);
        #[rustfmt::skip]
        let first = [
            0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0,
            0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0, 0, 8, 8, 0,
            0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0,
            0, 2, 14, 5, 10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0,
        ];
        assert_eq!(counts(&d, 0), first);
        #[rustfmt::skip]
        let last = [
            0, 0, 10, 14, 8, 1, 0, 0, 0, 2, 16, 14, 6, 1, 0, 0,
            0, 0, 15, 15, 8, 15, 0, 0, 0, 0, 5, 16, 16, 10, 0, 0,
            0, 0, 12, 15, 15, 12, 0, 0, 0, 4, 16, 6, 4, 16, 6, 0,
            0, 8, 16, 10, 8, 16, 8, 0, 0, 1, 8, 12, 14, 12, 1, 0,
        ];
        assert_eq!(counts(&d, 1796), last);
        assert_eq!(d.y[1796], 8);
        let total: u64 = (0..d.len())
            .flat_map(|i| counts(&d, i))
            .map(u64::from)
            .sum();
        assert_eq!(total, 561_718);
        println!(
            "digits.bin: {} bytes, fnv1a {:#018x}, {} samples, pixel total {total}",
            DIGITS_BIN.len(),
            fnv1a(DIGITS_BIN),
            d.len()
        );
        assert_eq!(fnv1a(DIGITS_BIN), FNV1A);
    }

    /// The checksum of `examples/data/digits.bin`.
    const FNV1A: u64 = 0x2335_a20b_deb2_59cd;

    fn file(n: u32, features: u32, pixels: &[u8], labels: &[u8]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&n.to_le_bytes());
        b.extend_from_slice(&features.to_le_bytes());
        b.extend_from_slice(pixels);
        b.extend_from_slice(labels);
        b
    }

    #[test]
    fn a_well_formed_file_parses() {
        let mut px = vec![0u8; 2 * FEATURES];
        px[0] = 16;
        px[FEATURES + 63] = 8;
        let d = parse(&file(2, 64, &px, &[3, 9])).unwrap();
        assert_eq!(d.y, vec![3, 9]);
        assert_eq!(d.x[0], 1.0);
        assert_eq!(d.x[FEATURES + 63], 0.5);
    }

    #[test]
    fn every_damage_is_a_typed_error() {
        let px = vec![0u8; FEATURES];
        assert_eq!(parse(b"RXDIG"), Err(DataError::Truncated { len: 5 }));
        let mut bad_magic = file(1, 64, &px, &[1]);
        bad_magic[0] = b'X';
        assert_eq!(parse(&bad_magic), Err(DataError::Magic));
        assert_eq!(
            parse(&file(1, 63, &px[..63], &[1])),
            Err(DataError::Features { features: 63 })
        );
        assert_eq!(parse(&file(0, 64, &[], &[])), Err(DataError::Empty));
        let short = file(2, 64, &px, &[1]);
        assert_eq!(
            parse(&short),
            Err(DataError::Length {
                len: 16 + 65,
                expected: 16 + 130
            })
        );
        let mut long = file(1, 64, &px, &[1]);
        long.push(0);
        assert!(matches!(parse(&long), Err(DataError::Length { .. })));
        let mut hot = px.clone();
        hot[10] = 17;
        assert_eq!(
            parse(&file(1, 64, &hot, &[1])),
            Err(DataError::Pixel {
                sample: 0,
                feature: 10,
                value: 17
            })
        );
        assert_eq!(
            parse(&file(1, 64, &px, &[10])),
            Err(DataError::Label {
                sample: 0,
                label: 10
            })
        );
        let e = parse(&file(1, 64, &px, &[10])).unwrap_err();
        assert_eq!(e.to_string(), "sample 0 has label 10, not a digit");
    }
}
