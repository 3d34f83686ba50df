//! Writes the global model after every round, as `.safetensors` (a JSON header and the
//! raw tensors; Python's `safetensors` and PyTorch read it directly).
//!
//! Every blob becomes an `F32` tensor when its length is a multiple of four, else a `U8`
//! tensor. Its shape is the one the model declares in its [`TENSOR_SHAPES`] metadata
//! (`{"weights": [10, 64]}`, which the trainer sets and the controller carries into the
//! global model) when that matches the blob's size, else one-dimensional. The round
//! and the job name go into `__metadata__`. The file is written to a temporary name and
//! renamed, so a reader never sees half a model.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use rankexec_protocol::{Shareable, Value};

/// The metadata key under which a model declares its tensors' shapes: a map from blob
/// name to a list of dimensions.
pub const TENSOR_SHAPES: &str = "tensor_shapes";

/// The declared shape of `name`, if it has one that fits `elements`.
fn declared_shape(model: &Shareable, name: &str, elements: usize) -> Option<Vec<u64>> {
    let Some(Value::Map(shapes)) = model.meta(TENSOR_SHAPES) else {
        return None;
    };
    let Some(Value::List(dims)) = shapes.get(name) else {
        return None;
    };
    let dims: Option<Vec<u64>> = dims
        .iter()
        .map(|d| d.as_i64().and_then(|d| u64::try_from(d).ok()))
        .collect();
    dims.filter(|d| d.iter().product::<u64>() == elements as u64)
}

/// Writes the model after each round.
#[derive(Debug, Clone)]
pub struct ModelPersistor {
    path: PathBuf,
}

impl ModelPersistor {
    /// A persistor writing to `path`.
    pub fn new(path: PathBuf) -> Self {
        ModelPersistor { path }
    }

    /// Where the model goes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `model` (its blobs) with `round` and `job` as metadata.
    pub fn save(&self, model: &Shareable, round: u32, job: &str) -> std::io::Result<()> {
        let mut header = serde_json::Map::new();
        let mut meta = BTreeMap::new();
        meta.insert("round".to_owned(), round.to_string());
        meta.insert("job".to_owned(), job.to_owned());
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(meta).map_err(std::io::Error::other)?,
        );
        let mut offset = 0usize;
        for (name, blob) in model.blobs() {
            let (dtype, elements) = if blob.len() % 4 == 0 {
                ("F32", blob.len() / 4)
            } else {
                ("U8", blob.len())
            };
            let shape = declared_shape(model, name, elements).unwrap_or(vec![elements as u64]);
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + blob.len()]}),
            );
            offset += blob.len();
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        // The data must start 8-byte aligned.
        while !text.len().is_multiple_of(8) {
            text.push(b' ');
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&(text.len() as u64).to_le_bytes())?;
        f.write_all(&text)?;
        for blob in model.blobs().values() {
            f.write_all(blob)?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)
    }
}

/// Reads a `.safetensors` file written by [`ModelPersistor::save`] back into blobs.
pub fn load(path: &Path) -> std::io::Result<(BTreeMap<String, String>, Shareable)> {
    let bytes = std::fs::read(path)?;
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
    let n = u64::from_le_bytes(
        bytes
            .get(..8)
            .ok_or_else(|| bad("short file"))?
            .try_into()
            .map_err(|_| bad("short file"))?,
    ) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..8 + n).ok_or_else(|| bad("short header"))?)
            .map_err(|e| bad(&e.to_string()))?;
    let data = &bytes[8 + n..];
    let mut meta = BTreeMap::new();
    let mut s = Shareable::new();
    for (k, v) in header
        .as_object()
        .ok_or_else(|| bad("header is not an object"))?
    {
        if k == "__metadata__" {
            if let Some(m) = v.as_object() {
                for (mk, mv) in m {
                    meta.insert(mk.clone(), mv.as_str().unwrap_or_default().to_owned());
                }
            }
            continue;
        }
        let off = &v["data_offsets"];
        let (a, b) = (
            off[0].as_u64().unwrap_or(0) as usize,
            off[1].as_u64().unwrap_or(0) as usize,
        );
        let chunk = data.get(a..b).ok_or_else(|| bad("offsets out of range"))?;
        s.set_blob(k.clone(), chunk.to_vec());
    }
    Ok((meta, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = ModelPersistor::new(dir.path().join("m.safetensors"));
        let model = Shareable::new()
            .with_blob("weights", vec![1u8, 2, 3, 4, 5, 6, 7, 8])
            .with_blob("odd", vec![9u8; 3]);
        p.save(&model, 3, "job").unwrap();
        let (meta, back) = load(p.path()).unwrap();
        assert_eq!(meta["round"], "3");
        assert_eq!(back, model);
    }

    /// The shape recorded in the file's header.
    fn shape_of(path: &Path, name: &str) -> serde_json::Value {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        header[name]["shape"].clone()
    }

    #[test]
    fn declared_shapes_are_kept_when_they_fit() {
        let dir = tempfile::tempdir().unwrap();
        let p = ModelPersistor::new(dir.path().join("m.safetensors"));
        let shapes = Value::from_json(&serde_json::json!({"w": [2, 3], "b": [4], "bad": [5]}));
        let model = Shareable::new()
            .with_blob("w", vec![0u8; 24])
            .with_blob("b", vec![0u8; 16])
            .with_blob("bad", vec![0u8; 8])
            .with_blob("flat", vec![0u8; 8])
            .with_meta(TENSOR_SHAPES, shapes);
        p.save(&model, 1, "job").unwrap();
        assert_eq!(shape_of(p.path(), "w"), serde_json::json!([2, 3]));
        assert_eq!(shape_of(p.path(), "b"), serde_json::json!([4]));
        assert_eq!(
            shape_of(p.path(), "bad"),
            serde_json::json!([2]),
            "a wrong shape is not used"
        );
        assert_eq!(shape_of(p.path(), "flat"), serde_json::json!([2]));
    }
}
