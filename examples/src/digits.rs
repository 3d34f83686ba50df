//! The digits data set and a softmax-regression classifier, in plain Rust.
//!
//! The data is the 8x8 handwritten digits set (1797 samples, 64 features, 10 classes)
//! embedded in this crate ([`dataset`](crate::dataset)): nothing is downloaded. Splits
//! are deterministic (a seeded shuffle), so every run and every rank sees the same
//! partition.
//!
//! The model is `logits = W x + b` with `W` 10x64 and `b` 10, trained by mini-batch SGD
//! on the cross-entropy loss. Its parameters travel as two little-endian `f32` blobs,
//! `weights` and `bias`, which the executor's `gather` policy and the server's FedAvg
//! can average.

use rankexec_protocol::{Blob, ComponentError, Shareable, Value};

use crate::dataset::DataError;

/// Default training hyper-parameters shared by the trainers' JSON arguments
/// (`#[serde(default = "digits::defaults::lr")]`).
pub mod defaults {
    /// Learning rate: 0.5.
    pub fn lr() -> f32 {
        0.5
    }
    /// Mini-batch size: 16.
    pub fn batch_size() -> usize {
        16
    }
    /// Seed of the train/test split: 2026.
    pub fn seed() -> u64 {
        2026
    }
    /// Share of the data held out for testing: 0.2.
    pub fn test_fraction() -> f64 {
        0.2
    }
}

/// Checks training hyper-parameters; the error names the argument, what it must be and
/// what it was.
pub fn check_hyper_parameters(
    epochs: u32,
    lr: f32,
    batch_size: usize,
    test_fraction: f64,
) -> Result<(), String> {
    if epochs == 0 {
        return Err("epochs must be at least 1, got 0".into());
    }
    if !(lr.is_finite() && lr > 0.0) {
        return Err(format!("lr must be a positive number, got {lr}"));
    }
    if batch_size == 0 {
        return Err("batch_size must be at least 1, got 0".into());
    }
    if !(test_fraction > 0.0 && test_fraction < 1.0) {
        return Err(format!(
            "test_fraction must be between 0 and 1 (exclusive), got {test_fraction}"
        ));
    }
    Ok(())
}

/// Features per sample.
pub const FEATURES: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;

/// Samples as rows of `FEATURES` values in [0, 1], with labels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Data {
    /// Row-major features.
    pub x: Vec<f32>,
    /// Labels 0..9.
    pub y: Vec<u8>,
}

impl Data {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    fn row(&self, i: usize) -> &[f32] {
        &self.x[i * FEATURES..(i + 1) * FEATURES]
    }

    /// The samples at `idx`.
    pub fn select(&self, idx: impl IntoIterator<Item = usize>) -> Data {
        let mut d = Data::default();
        for i in idx {
            d.x.extend_from_slice(self.row(i));
            d.y.push(self.y[i]);
        }
        d
    }
}

/// A small, fast, deterministic generator (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Shuffles in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// How clients' data is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Partition {
    /// Every client gets a random share of every class.
    #[default]
    Iid,
    /// Samples sorted by label and dealt in contiguous blocks: each client sees few classes.
    NonIid,
}

/// The whole data set, split into train and test parts by a seeded shuffle.
pub fn load(seed: u64, test_fraction: f64) -> Result<(Data, Data), DataError> {
    let all = crate::dataset::digits()?;
    let n = all.len();
    let mut idx: Vec<usize> = (0..n).collect();
    Rng::new(seed).shuffle(&mut idx);
    let n_test = ((n as f64) * test_fraction).round() as usize;
    let test = all.select(idx[..n_test].iter().copied());
    let train = all.select(idx[n_test..].iter().copied());
    Ok((train, test))
}

/// Client `index`'s share (0-based) of `data` among `clients`.
pub fn client_share(data: &Data, index: usize, clients: usize, partition: Partition) -> Data {
    let clients = clients.max(1);
    match partition {
        Partition::Iid => data.select((0..data.len()).filter(|i| i % clients == index)),
        Partition::NonIid => {
            let mut idx: Vec<usize> = (0..data.len()).collect();
            idx.sort_by_key(|i| (data.y[*i], *i));
            let per = data.len().div_ceil(clients);
            data.select(idx.into_iter().skip(index * per).take(per))
        }
    }
}

/// A rank's share (strided) of a client's data.
pub fn rank_share(data: &Data, rank: usize, world: usize) -> Data {
    let world = world.max(1);
    data.select((0..data.len()).filter(|i| i % world == rank))
}

/// Softmax regression parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// `CLASSES x FEATURES`, row-major.
    pub w: Vec<f32>,
    /// `CLASSES`.
    pub b: Vec<f32>,
}

impl Default for Model {
    fn default() -> Self {
        Model {
            w: vec![0.0; CLASSES * FEATURES],
            b: vec![0.0; CLASSES],
        }
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl Model {
    /// Reads `weights` and `bias` from a shareable; a shareable without them is the
    /// initial (zero) model.
    pub fn from_shareable(s: &Shareable) -> Result<Model, ComponentError> {
        match (s.blob("weights"), s.blob("bias")) {
            (None, None) => Ok(Model::default()),
            (Some(w), Some(b)) if w.len() == CLASSES * FEATURES * 4 && b.len() == CLASSES * 4 => {
                Ok(Model {
                    w: f32s(w),
                    b: f32s(b),
                })
            }
            _ => Err(ComponentError::failed(format!(
                "model blobs must be weights ({} f32) and bias ({} f32)",
                CLASSES * FEATURES,
                CLASSES
            ))),
        }
    }

    /// Puts `weights` and `bias` into a shareable, with their shapes (`[10, 64]` and
    /// `[10]`) in meta `tensor_shapes`, which the server's model persistor writes.
    pub fn into_shareable(&self, s: Shareable) -> Shareable {
        let mut shapes = std::collections::BTreeMap::new();
        let dims = |d: &[usize]| Value::List(d.iter().map(|x| Value::Int(*x as i64)).collect());
        shapes.insert("weights".to_owned(), dims(&[CLASSES, FEATURES]));
        shapes.insert("bias".to_owned(), dims(&[CLASSES]));
        s.with_blob("weights", Blob::from(bytes(&self.w)))
            .with_blob("bias", Blob::from(bytes(&self.b)))
            .with_meta("tensor_shapes", Value::Map(shapes))
    }

    fn logits(&self, x: &[f32], out: &mut [f32; CLASSES]) {
        for (c, o) in out.iter_mut().enumerate() {
            let row = &self.w[c * FEATURES..(c + 1) * FEATURES];
            *o = self.b[c] + row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
        }
    }

    fn softmax(z: &mut [f32; CLASSES]) {
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0;
        for v in z.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        for v in z.iter_mut() {
            *v /= s;
        }
    }

    /// Adds the cross-entropy gradient of `data[idx]` to `(gw, gb)`; returns the loss sum.
    pub fn accumulate_gradient(
        &self,
        data: &Data,
        idx: &[usize],
        gw: &mut [f32],
        gb: &mut [f32],
    ) -> f32 {
        let mut p = [0f32; CLASSES];
        let mut loss = 0.0;
        for &i in idx {
            let x = data.row(i);
            self.logits(x, &mut p);
            Self::softmax(&mut p);
            let y = data.y[i] as usize;
            loss -= p[y].max(1e-12).ln();
            for c in 0..CLASSES {
                let d = p[c] - if c == y { 1.0 } else { 0.0 };
                gb[c] += d;
                for (g, xv) in gw[c * FEATURES..(c + 1) * FEATURES].iter_mut().zip(x) {
                    *g += d * xv;
                }
            }
        }
        loss
    }

    /// Applies `-lr / n * (gw, gb)`.
    pub fn step(&mut self, gw: &[f32], gb: &[f32], lr: f32, n: usize) {
        let s = lr / n.max(1) as f32;
        for (w, g) in self.w.iter_mut().zip(gw) {
            *w -= s * g;
        }
        for (b, g) in self.b.iter_mut().zip(gb) {
            *b -= s * g;
        }
    }

    /// Mini-batch SGD for `epochs` over `data`, shuffled by `rng`. Returns the mean loss
    /// of the last epoch. Stops early (returning `None`) when `stop` says so.
    pub fn train(
        &mut self,
        data: &Data,
        epochs: u32,
        batch: usize,
        lr: f32,
        rng: &mut Rng,
        stop: impl Fn() -> bool,
    ) -> Option<f32> {
        let mut idx: Vec<usize> = (0..data.len()).collect();
        let mut gw = vec![0f32; CLASSES * FEATURES];
        let mut gb = vec![0f32; CLASSES];
        let mut last = 0.0;
        for _ in 0..epochs {
            rng.shuffle(&mut idx);
            let mut total = 0.0;
            for chunk in idx.chunks(batch.max(1)) {
                if stop() {
                    return None;
                }
                gw.iter_mut().for_each(|g| *g = 0.0);
                gb.iter_mut().for_each(|g| *g = 0.0);
                total += self.accumulate_gradient(data, chunk, &mut gw, &mut gb);
                self.step(&gw, &gb, lr, chunk.len());
            }
            last = total / data.len().max(1) as f32;
        }
        Some(last)
    }

    /// Accuracy and mean loss on `data`.
    pub fn evaluate(&self, data: &Data) -> (f64, f64) {
        let mut p = [0f32; CLASSES];
        let (mut correct, mut loss) = (0usize, 0f64);
        for i in 0..data.len() {
            self.logits(data.row(i), &mut p);
            let pred = p
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(c, _)| c);
            Self::softmax(&mut p);
            let y = data.y[i] as usize;
            loss -= f64::from(p[y].max(1e-12).ln());
            if pred == y {
                correct += 1;
            }
        }
        let n = data.len().max(1) as f64;
        (correct as f64 / n, loss / n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn central_training_reaches_high_accuracy() {
        let (train, test) = load(7, 0.2).unwrap();
        assert_eq!(train.len() + test.len(), 1797);
        let mut m = Model::default();
        m.train(&train, 10, 16, 0.5, &mut Rng::new(1), || false)
            .unwrap();
        let (acc, _) = m.evaluate(&test);
        assert!(acc > 0.93, "accuracy {acc}");
    }

    #[test]
    fn shares_partition_the_data() {
        let (train, _) = load(7, 0.2).unwrap();
        let parts: usize = (0..3)
            .map(|i| client_share(&train, i, 3, Partition::Iid).len())
            .sum();
        assert_eq!(parts, train.len());
        let parts: usize = (0..3)
            .map(|i| client_share(&train, i, 3, Partition::NonIid).len())
            .sum();
        assert_eq!(parts, train.len());
        let c = client_share(&train, 0, 3, Partition::NonIid);
        let classes: std::collections::BTreeSet<u8> = c.y.iter().copied().collect();
        assert!(
            classes.len() <= 5,
            "non-IID clients see few classes: {classes:?}"
        );
        let ranks: usize = (0..2).map(|r| rank_share(&c, r, 2).len()).sum();
        assert_eq!(ranks, c.len());
    }

    #[test]
    fn model_round_trips_through_a_shareable() {
        let mut m = Model::default();
        m.w[5] = 1.5;
        m.b[2] = -2.0;
        let back = Model::from_shareable(&m.into_shareable(Shareable::new())).unwrap();
        assert_eq!(back, m);
    }
}
