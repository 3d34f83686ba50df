//! What GPUs this host has, as a plain value that placement can reason about.

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
        let kept: Vec<GpuInfo> = gpus
            .into_iter()
            .filter(|g| {
                wanted
                    .iter()
                    .any(|w| *w == g.index.to_string() || g.uuid.starts_with(w))
            })
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
