//! Averaging results: what a task returns when N ranks ran it, and FedAvg.
//!
//! - `rank0` (FLARE's rule): rank 0's shareable and context.
//! - `gather`: every rank returns its shareable; named blobs holding little-endian `f32`
//!   arrays are averaged, weighted by each rank's numeric meta `weight_key` (its sample
//!   count). This lets N ranks train on shards of local data and combine their models
//!   without a collective library (local SGD with model averaging).
//!
//! [`weighted_average`] is the one implementation; a federated server uses it for
//! FedAvg across clients too. It can write large averages straight into sealed shared
//! memory ([`Blob::shared_with`]), so a global model that is then sent to every client's
//! ranks is never copied again: each rank maps the same pages.

use rankexec_protocol::wire::message::Props;
use rankexec_protocol::{Blob, Shareable};

use crate::error::GatherError;

/// One result to average.
#[derive(Debug, Clone, Copy)]
pub struct Weighted<'a> {
    /// Whose it is, for errors (`rank 1`, `site-2`).
    pub who: &'a str,
    /// Its weight.
    pub weight: f64,
    /// The result.
    pub shareable: &'a Shareable,
}

/// The numeric meta `key` of a result, as a weight.
pub fn weight_of(who: &str, s: &Shareable, key: &str) -> Result<f64, GatherError> {
    s.meta(key)
        .and_then(|v| v.as_f64())
        .ok_or_else(|| GatherError::MissingWeight {
            who: who.to_owned(),
            key: key.to_owned(),
        })
}

/// Averages the `f32` blobs `names` over `parts`, weighted. Accumulates in `f64`.
///
/// An average of at least `shared_from` bytes is written once, in place, into a sealed
/// memory file (falling back to ordinary memory if one cannot be made); pass
/// `usize::MAX` to keep every average in ordinary memory.
///
/// ```
/// use rankexec_executor::result::{Weighted, weighted_average};
/// use rankexec_protocol::Shareable;
/// let f = |v: f32| Shareable::new().with_blob("w", v.to_le_bytes().to_vec());
/// let (a, b) = (f(0.0), f(4.0));
/// let avg = weighted_average(
///     &[Weighted { who: "a", weight: 3.0, shareable: &a }, Weighted { who: "b", weight: 1.0, shareable: &b }],
///     &["w".to_string()],
///     usize::MAX,
/// ).unwrap();
/// assert_eq!(&avg[0].1[..], &1.0f32.to_le_bytes()[..]);
/// ```
pub fn weighted_average(
    parts: &[Weighted<'_>],
    names: &[String],
    shared_from: usize,
) -> Result<Vec<(String, Blob)>, GatherError> {
    let first = parts.first().ok_or(GatherError::Empty)?;
    let total: f64 = parts.iter().map(|p| p.weight).sum();
    if total <= 0.0 || !total.is_finite() {
        return Err(GatherError::ZeroWeight {
            key: "weight".to_owned(),
            total,
        });
    }
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let len = first
            .shareable
            .blob(name)
            .ok_or_else(|| GatherError::MissingBlob {
                who: first.who.to_owned(),
                name: name.clone(),
            })?
            .len();
        if len % 4 != 0 {
            return Err(GatherError::NotF32 {
                name: name.clone(),
                len,
            });
        }
        // Every part is checked before the accumulator is sized: one rank's length
        // alone never decides an allocation (each blob is within `max_frame` already).
        let mut blobs = Vec::with_capacity(parts.len());
        for p in parts {
            let b = p
                .shareable
                .blob(name)
                .ok_or_else(|| GatherError::MissingBlob {
                    who: p.who.to_owned(),
                    name: name.clone(),
                })?;
            if b.len() != len {
                return Err(GatherError::LengthMismatch {
                    who: p.who.to_owned(),
                    name: name.clone(),
                    len: b.len(),
                    expected: len,
                });
            }
            blobs.push((p, b));
        }
        let mut acc = vec![0f64; len / 4];
        for (p, b) in blobs {
            for (a, chunk) in acc.iter_mut().zip(b.chunks_exact(4)) {
                let mut x = [0u8; 4];
                x.copy_from_slice(chunk);
                *a += f64::from(f32::from_le_bytes(x)) * p.weight;
            }
        }
        let fill = |buf: &mut [u8]| {
            for (dst, a) in buf.chunks_exact_mut(4).zip(&acc) {
                dst.copy_from_slice(&((a / total) as f32).to_le_bytes());
            }
        };
        let shared = (len >= shared_from)
            .then(|| Blob::shared_with(len, fill))
            .and_then(|r| {
                r.map_err(|e| tracing::debug!("average `{name}` kept in ordinary memory: {e}"))
                    .ok()
            });
        let blob = shared.unwrap_or_else(|| {
            let mut v = vec![0u8; len];
            fill(&mut v);
            Blob::from(v)
        });
        out.push((name.clone(), blob));
    }
    Ok(out)
}

/// The `gather` policy: averages every rank's output (in rank order).
pub(crate) fn reduce(
    mut outputs: Vec<(Props, Shareable)>,
    weight_key: &str,
    average: &[String],
) -> Result<(Shareable, Props), GatherError> {
    let names: Vec<String> = (0..outputs.len()).map(|r| format!("rank {r}")).collect();
    let mut parts = Vec::with_capacity(outputs.len());
    for ((_, s), who) in outputs.iter().zip(&names) {
        parts.push(Weighted {
            who,
            weight: weight_of(who, s, weight_key)?,
            shareable: s,
        });
    }
    let total: f64 = parts.iter().map(|p| p.weight).sum();
    // The average goes back to the host, not to ranks: ordinary memory.
    let averaged = weighted_average(&parts, average, usize::MAX).map_err(|e| match e {
        GatherError::ZeroWeight { total, .. } => GatherError::ZeroWeight {
            key: weight_key.to_owned(),
            total,
        },
        other => other,
    })?;
    let (props, mut out) = outputs.swap_remove(0);
    for (name, bytes) in averaged {
        out.set_blob(name, bytes);
    }
    out.set_meta(weight_key, total);
    Ok((out, props))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn out(w: f64, vals: &[f32]) -> (Props, Shareable) {
        (
            Props::new(),
            Shareable::new()
                .with_meta("n", w)
                .with_blob("w", f32s(vals)),
        )
    }

    #[test]
    fn weighted_average_of_blobs() {
        let (s, _) = reduce(
            vec![out(1.0, &[0.0, 4.0]), out(3.0, &[4.0, 0.0])],
            "n",
            &["w".into()],
        )
        .unwrap();
        let b = s.blob("w").unwrap();
        let vals: Vec<f32> = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(vals, [3.0, 1.0]);
        assert_eq!(s.meta("n").and_then(|v| v.as_f64()), Some(4.0));
    }

    #[test]
    fn large_averages_are_built_in_shared_memory() {
        let (a, b) = (out(1.0, &[1.0; 64]).1, out(1.0, &[3.0; 64]).1);
        let parts = [
            Weighted {
                who: "a",
                weight: 1.0,
                shareable: &a,
            },
            Weighted {
                who: "b",
                weight: 1.0,
                shareable: &b,
            },
        ];
        let names = ["w".to_owned()];
        let shared = weighted_average(&parts, &names, 256).unwrap();
        let heap = weighted_average(&parts, &names, 257).unwrap();
        assert!(shared[0].1.is_shared(), "256 bytes >= 256: shared");
        assert!(!heap[0].1.is_shared(), "256 bytes < 257: ordinary memory");
        assert_eq!(&shared[0].1[..], &heap[0].1[..]);
        assert_eq!(&heap[0].1[..], &f32s(&[2.0; 64])[..]);
    }

    #[test]
    fn mismatches_are_errors() {
        let e = reduce(
            vec![out(1.0, &[0.0]), out(1.0, &[0.0, 1.0])],
            "n",
            &["w".into()],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 1's blob `w` has 8 bytes, the first result's has 4"
        );
        let e = reduce(vec![out(1.0, &[0.0])], "m", &["w".into()]).unwrap_err();
        assert_eq!(e.to_string(), "rank 0 returned no numeric meta `m`");
        let e = reduce(vec![out(0.0, &[0.0])], "n", &["w".into()]).unwrap_err();
        assert_eq!(e.to_string(), "the weights `n` add up to 0");
    }
}
