//! What GPUs this host has, as a plain value that placement can reason about.
//!
//! A site may also *declare* its GPUs instead of asking NVML: `RANKEXEC_GPU_INVENTORY`
//! (for example `2x16GiB`, see [`parse_fixed`]) in the environment of the process that
//! places ranks gives it that fixed inventory. It is a site setting, for sites where
//! NVML cannot be read (and for tests without a GPU): every process of the site (a FLARE
//! client, its job processes, their executors) must see the same value.

use std::fmt;

use serde::Serialize;

/// One GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    /// NVML index (PCI bus order).
    pub index: u32,
    /// `GPU-…` UUID, stable across reboots and index orders.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Total memory, bytes.
    pub memory_total: u64,
    /// Free memory, bytes.
    pub memory_free: u64,
    /// Used memory, bytes.
    pub memory_used: u64,
    /// GPU utilization, percent, if the driver reports it.
    pub utilization_gpu: Option<u32>,
    /// Memory-controller utilization, percent, if the driver reports it.
    pub utilization_memory: Option<u32>,
    /// Compute processes on it: pid and used memory (bytes) when reported.
    pub processes: Vec<(u32, Option<u64>)>,
}

/// The GPUs of this host, or why there are none.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Inventory {
    /// GPUs were found.
    Gpus {
        /// The driver version, if known.
        driver: Option<String>,
        /// The GPUs.
        gpus: Vec<GpuInfo>,
    },
    /// No GPUs: no driver, NVML failed, or none are installed or visible.
    NoGpus {
        /// Why.
        reason: String,
    },
}

impl Inventory {
    /// The GPUs (empty when there are none).
    pub fn gpus(&self) -> &[GpuInfo] {
        match self {
            Inventory::Gpus { gpus, .. } => gpus,
            Inventory::NoGpus { .. } => &[],
        }
    }

    /// Keeps only the GPUs named in a `CUDA_VISIBLE_DEVICES`-style list (indices or
    /// UUIDs, comma separated): when the host itself was given a subset of the GPUs
    /// (by a scheduler or a resource manager), its ranks must stay inside it.
    pub fn restrict_to_visible(self, visible: Option<&str>) -> Inventory {
        let Some(visible) = visible else { return self };
        let Inventory::Gpus { driver, gpus } = self else {
            return self;
        };
        let wanted: Vec<&str> = visible
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        // An index names one GPU; anything else is a UUID or a prefix of one (as CUDA
        // reads them). A fixed inventory's UUIDs are indices, so "1" must not match "10".
        let names = |w: &str, g: &GpuInfo| {
            if w.parse::<u32>().is_ok() {
                w == g.index.to_string() || w == g.uuid
            } else {
                g.uuid.starts_with(w)
            }
        };
        let kept: Vec<GpuInfo> = gpus
            .into_iter()
            .filter(|g| wanted.iter().any(|w| names(w, g)))
            .collect();
        if kept.is_empty() {
            Inventory::NoGpus {
                reason: format!("CUDA_VISIBLE_DEVICES={visible:?} hides every GPU"),
            }
        } else {
            Inventory::Gpus { driver, gpus: kept }
        }
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl fmt::Display for Inventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Inventory::NoGpus { reason } => write!(f, "no GPUs: {reason}"),
            Inventory::Gpus { driver, gpus } => {
                writeln!(
                    f,
                    "{} GPU(s){}",
                    gpus.len(),
                    driver
                        .as_ref()
                        .map(|d| format!(", driver {d}"))
                        .unwrap_or_default()
                )?;
                writeln!(
                    f,
                    "{:>5}  {:<40}  {:<24}  {:>10}  {:>10}  {:>5}  {:>5}  {:>5}",
                    "index", "uuid", "name", "total GiB", "free GiB", "gpu%", "mem%", "procs"
                )?;
                for g in gpus {
                    writeln!(
                        f,
                        "{:>5}  {:<40}  {:<24}  {:>10.2}  {:>10.2}  {:>5}  {:>5}  {:>5}",
                        g.index,
                        g.uuid,
                        g.name,
                        gib(g.memory_total),
                        gib(g.memory_free),
                        g.utilization_gpu.map_or("-".into(), |u| u.to_string()),
                        g.utilization_memory.map_or("-".into(), |u| u.to_string()),
                        g.processes.len()
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// A source of GPU inventories.
pub trait GpuProbe: Send + Sync {
    /// The GPUs now.
    fn inventory(&self) -> Inventory;
}

/// A fixed inventory: to plan placements for a known machine, and to test placement.
#[derive(Debug, Clone)]
pub struct FixedInventory(pub Inventory);

impl GpuProbe for FixedInventory {
    fn inventory(&self) -> Inventory {
        self.0.clone()
    }
}

/// The variable that declares a site's GPUs instead of NVML (see [`parse_fixed`]).
pub const INVENTORY_ENV: &str = "RANKEXEC_GPU_INVENTORY";

/// A declared inventory that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid GPU inventory `{spec}`: {why} (expected GPUs as `COUNTxSIZE` or `SIZE`, comma separated, e.g. `2x16GiB` or `80GiB,2x24GiB`; or `none`)"
)]
pub struct InventorySpecError {
    /// The text given.
    pub spec: String,
    /// What is wrong with it.
    pub why: String,
}

/// Most GPUs a declared inventory may list (a typo such as `2000x16GiB` is refused).
const MAX_FIXED_GPUS: u32 = 1024;

/// Parses a declared inventory: comma-separated items, each `SIZE` (one GPU) or
/// `COUNTxSIZE`, where SIZE is a byte size such as `16GiB`; `none` or `0` declares no
/// GPU. GPU `i` (in the order written) gets index `i` and the *UUID* `"i"`, so that
/// `CUDA_VISIBLE_DEVICES` given to ranks names CUDA device indices: on a site that has
/// real GPUs but no NVML, the ranks still see the right devices. Every GPU is idle
/// (free = total): a declared inventory knows nothing of other programs' use.
pub fn parse_fixed(spec: &str) -> Result<Inventory, InventorySpecError> {
    let err = |why: String| InventorySpecError {
        spec: spec.to_owned(),
        why,
    };
    let text = spec.trim();
    if text.eq_ignore_ascii_case("none") || text == "0" {
        return Ok(Inventory::NoGpus {
            reason: format!("{INVENTORY_ENV}={spec:?} declares no GPU"),
        });
    }
    let mut sizes = Vec::new();
    for item in text.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(err("an empty item".into()));
        }
        let (count, size) = match item.split_once(['x', 'X']) {
            Some((n, size)) => {
                let n: u32 = n
                    .trim()
                    .parse()
                    .map_err(|_| err(format!("`{}` is not a GPU count", n.trim())))?;
                (n, size.trim())
            }
            None => (1, item),
        };
        let bytes = size
            .parse::<crate::units::ByteSize>()
            .map_err(|e| err(e.to_string()))?
            .bytes();
        if bytes == 0 {
            return Err(err(format!("`{item}` declares GPUs without memory")));
        }
        for _ in 0..count {
            sizes.push(bytes);
            if sizes.len() > MAX_FIXED_GPUS as usize {
                return Err(err(format!("more than {MAX_FIXED_GPUS} GPUs")));
            }
        }
    }
    if sizes.is_empty() {
        return Err(err("no GPU (write `none` to declare none)".into()));
    }
    let gpus = sizes
        .into_iter()
        .enumerate()
        .map(|(i, bytes)| GpuInfo {
            index: i as u32,
            uuid: i.to_string(),
            name: "declared GPU".to_owned(),
            memory_total: bytes,
            memory_free: bytes,
            memory_used: 0,
            utilization_gpu: None,
            utilization_memory: None,
            processes: Vec::new(),
        })
        .collect();
    Ok(Inventory::Gpus { driver: None, gpus })
}

/// The inventory declared by [`INVENTORY_ENV`] in this process's environment, if set
/// (a value that does not parse is "no GPUs" with the parse error as the reason).
pub fn declared() -> Option<Inventory> {
    let value = std::env::var_os(INVENTORY_ENV)?;
    Some(match value.to_str().map(parse_fixed) {
        Some(Ok(inv)) => inv,
        Some(Err(e)) => Inventory::NoGpus {
            reason: format!("{INVENTORY_ENV}: {e}"),
        },
        None => Inventory::NoGpus {
            reason: format!("{INVENTORY_ENV} is not UTF-8"),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn declared_inventories_parse() {
        let inv = parse_fixed("2x16GiB, 80GiB").unwrap();
        let g = inv.gpus();
        assert_eq!(g.len(), 3);
        assert_eq!((g[0].index, g[0].uuid.as_str()), (0, "0"));
        assert_eq!(g[1].memory_total, 16 * GIB);
        assert_eq!(g[2].memory_free, 80 * GIB);
        assert!(matches!(parse_fixed("none"), Ok(Inventory::NoGpus { .. })));
        for bad in [
            "",
            "2x",
            "twox16GiB",
            "2x16 parsecs",
            "0GiB",
            "16GiB,,16GiB",
            "5000x1GiB",
        ] {
            let e = parse_fixed(bad).unwrap_err();
            assert!(e.to_string().contains("invalid GPU inventory"), "{e}");
        }
    }

    #[test]
    fn an_index_never_matches_a_longer_index() {
        let inv = parse_fixed("12x1GiB").unwrap();
        let kept = inv.restrict_to_visible(Some("1,11"));
        let idx: Vec<u32> = kept.gpus().iter().map(|g| g.index).collect();
        assert_eq!(idx, [1, 11]);
    }
}
