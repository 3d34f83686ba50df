//! Writes the global model after every round, as `.safetensors` (a JSON header and the
//! raw tensors; Python's `safetensors` and PyTorch read it directly).
//!
//! Every blob becomes a one-dimensional `F32` tensor when its length is a multiple of
//! four, else a `U8` tensor; the round and the job name go into `__metadata__`. The file
//! is written to a temporary name and renamed, so a reader never sees half a model.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use rankexec_protocol::Shareable;

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
            let (dtype, shape) = if blob.len() % 4 == 0 {
                ("F32", blob.len() / 4)
            } else {
                ("U8", blob.len())
            };
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": [shape], "data_offsets": [offset, offset + blob.len()]}),
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
}
