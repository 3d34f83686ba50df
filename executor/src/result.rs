//! Result policies: what a task returns when N ranks ran it.
//!
//! - `rank0` (FLARE's rule): rank 0's shareable and context.
//! - `gather`: every rank returns its shareable; named blobs holding little-endian `f32`
//!   arrays are averaged, weighted by each rank's numeric meta `weight_key` (its sample
//!   count). This lets N ranks train on shards of local data and combine their models
//!   without a collective library (local SGD with model averaging).

use rankexec_protocol::Shareable;
use rankexec_protocol::wire::message::Props;

use crate::error::GatherError;

/// Combines every rank's output (in rank order) by weighted averaging.
pub(crate) fn reduce(
    mut outputs: Vec<(Props, Shareable)>,
    weight_key: &str,
    average: &[String],
) -> Result<(Shareable, Props), GatherError> {
    let mut weights = Vec::with_capacity(outputs.len());
    for (rank, (_, s)) in outputs.iter().enumerate() {
        let w = s.meta(weight_key).and_then(|v| v.as_f64()).ok_or_else(|| {
            GatherError::MissingWeight {
                rank: rank as u32,
                key: weight_key.to_owned(),
            }
        })?;
        weights.push(w);
    }
    let total: f64 = weights.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return Err(GatherError::ZeroWeight {
            key: weight_key.to_owned(),
            total,
        });
    }
    let mut averaged = Vec::with_capacity(average.len());
    for name in average {
        let first = outputs[0]
            .1
            .blob(name)
            .ok_or_else(|| GatherError::MissingBlob {
                rank: 0,
                name: name.clone(),
            })?;
        let len = first.len();
        if len % 4 != 0 {
            return Err(GatherError::NotF32 {
                name: name.clone(),
                len,
            });
        }
        let mut acc = vec![0f64; len / 4];
        for (rank, ((_, s), w)) in outputs.iter().zip(&weights).enumerate() {
            let b = s.blob(name).ok_or_else(|| GatherError::MissingBlob {
                rank: rank as u32,
                name: name.clone(),
            })?;
            if b.len() != len {
                return Err(GatherError::LengthMismatch {
                    rank: rank as u32,
                    name: name.clone(),
                    len: b.len(),
                    expected: len,
                });
            }
            for (a, chunk) in acc.iter_mut().zip(b.chunks_exact(4)) {
                let mut x = [0u8; 4];
                x.copy_from_slice(chunk);
                *a += f64::from(f32::from_le_bytes(x)) * w;
            }
        }
        let bytes: Vec<u8> = acc
            .into_iter()
            .flat_map(|a| ((a / total) as f32).to_le_bytes())
            .collect();
        averaged.push((name.clone(), bytes));
    }
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
    fn mismatches_are_errors() {
        let e = reduce(
            vec![out(1.0, &[0.0]), out(1.0, &[0.0, 1.0])],
            "n",
            &["w".into()],
        )
        .unwrap_err();
        assert!(matches!(e, GatherError::LengthMismatch { rank: 1, .. }));
        let e = reduce(vec![out(1.0, &[0.0])], "m", &["w".into()]).unwrap_err();
        assert!(matches!(e, GatherError::MissingWeight { rank: 0, .. }));
        let e = reduce(vec![out(0.0, &[0.0])], "n", &["w".into()]).unwrap_err();
        assert!(matches!(e, GatherError::ZeroWeight { .. }));
    }
}
