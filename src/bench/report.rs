//! Figures and how they are printed: a table, or one JSON object per line.

use std::collections::BTreeMap;

use serde::Serialize;

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// Who measured it.
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    /// `startup`, `roundtrip_empty`, `fanout`, `memcpy`, `event_relay`,
    /// `abort_cooperative`, `abort_forced`, `crash_detect` or `parent_peak_rss`.
    pub name: &'static str,
    /// Ranks in the group (null where none).
    pub ranks: Option<u32>,
    /// Payload size (null where none).
    pub payload_bytes: Option<u64>,
    /// The median.
    pub value: f64,
    /// `ms`, `us`, `events/s`, `bytes`.
    pub unit: &'static str,
    /// How many samples the median is of.
    pub samples: usize,
    /// The smallest sample.
    pub min: f64,
    /// The largest sample.
    pub max: f64,
    /// Anything else (ratios, variants).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Median, min and max of samples.
pub fn stats(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let median = if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    };
    (median, samples[0], samples[n - 1])
}

impl Figure {
    /// A figure from samples.
    pub fn new(
        name: &'static str,
        ranks: Option<u32>,
        payload: Option<u64>,
        unit: &'static str,
        mut samples: Vec<f64>,
    ) -> Figure {
        let (value, min, max) = stats(&mut samples);
        Figure {
            implementation: "rankexec",
            name,
            ranks,
            payload_bytes: payload,
            value,
            unit,
            samples: samples.len(),
            min,
            max,
            extra: BTreeMap::new(),
        }
    }

    /// Adds an extra field.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Figure {
        self.extra.insert(key.to_owned(), value.into());
        self
    }
}

fn size(b: Option<u64>) -> String {
    match b {
        None => "-".to_owned(),
        Some(b) if b >= 1 << 30 => format!("{} GiB", b >> 30),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) if b >= 1 << 10 => format!("{} KiB", b >> 10),
        Some(b) => format!("{b} B"),
    }
}

/// Prints one figure as a table row (or a JSON line).
pub fn print(f: &Figure, json: bool) {
    if json {
        if let Ok(line) = serde_json::to_string(f) {
            println!("{line}");
        }
        return;
    }
    let extra: Vec<String> = f
        .extra
        .iter()
        .map(|(k, v)| match v {
            serde_json::Value::Number(n) => format!("{k}={:.3}", n.as_f64().unwrap_or_default()),
            serde_json::Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect();
    println!(
        "{:<18} {:>5} {:>9} {:>14} {:<9} (min {:.3}, max {:.3}, n={}) {}",
        f.name,
        f.ranks.map_or("-".to_owned(), |r| r.to_string()),
        size(f.payload_bytes),
        format!("{:.3}", f.value),
        f.unit,
        f.min,
        f.max,
        f.samples,
        extra.join(" ")
    );
}
