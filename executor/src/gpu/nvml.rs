//! The GPU inventory from NVML.
//!
//! `nvml-wrapper` loads `libnvidia-ml.so.1` at run time, so this builds and runs on any
//! machine: when the library is missing, the driver is not loaded, or permission is
//! denied, [`NvmlProbe`] reports [`Inventory::NoGpus`] with NVML's reason, and ranks run
//! on CPUs (unless `require_gpu`). One `Nvml` handle is kept for the program's life.
//!
//! A site that declares its GPUs (`RANKEXEC_GPU_INVENTORY`, see
//! [`super::inventory::parse_fixed`]) gets that inventory instead, and NVML is not loaded.
//!
//! NVML numbers GPUs in PCI bus order while CUDA defaults to "fastest first", so ranks
//! are given UUIDs in `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER=PCI_BUS_ID`.

use std::sync::OnceLock;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

use super::inventory::{GpuInfo, GpuProbe, Inventory};

static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();

fn nvml() -> Result<&'static Nvml, String> {
    NVML.get_or_init(|| Nvml::init().map_err(|e| format!("NVML is unavailable ({e})")))
        .as_ref()
        .map_err(Clone::clone)
}

/// Reads GPUs through NVML, honouring the host's own `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmlProbe;

impl NvmlProbe {
    /// The unrestricted inventory (every GPU NVML sees, or the site's declared one).
    pub fn all(&self) -> Inventory {
        if let Some(declared) = super::inventory::declared() {
            return declared;
        }
        let nvml = match nvml() {
            Ok(n) => n,
            Err(reason) => return Inventory::NoGpus { reason },
        };
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                return Inventory::NoGpus {
                    reason: format!("NVML cannot count devices ({e})"),
                };
            }
        };
        if count == 0 {
            return Inventory::NoGpus {
                reason: "the NVIDIA driver reports no GPUs".to_owned(),
            };
        }
        let mut gpus = Vec::new();
        for index in 0..count {
            let dev = match nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(index, error = %e, "cannot open GPU; skipping it");
                    continue;
                }
            };
            let (Ok(uuid), Ok(mem)) = (dev.uuid(), dev.memory_info()) else {
                tracing::warn!(index, "cannot read GPU UUID or memory; skipping it");
                continue;
            };
            let util = dev.utilization_rates().ok();
            let processes = dev
                .running_compute_processes()
                .map(|ps| {
                    ps.into_iter()
                        .map(|p| {
                            let used = match p.used_gpu_memory {
                                UsedGpuMemory::Used(b) => Some(b),
                                UsedGpuMemory::Unavailable => None,
                            };
                            (p.pid, used)
                        })
                        .collect()
                })
                .unwrap_or_default();
            gpus.push(GpuInfo {
                index,
                uuid,
                name: dev.name().unwrap_or_else(|_| "unknown".to_owned()),
                memory_total: mem.total,
                memory_free: mem.free,
                memory_used: mem.used,
                utilization_gpu: util.as_ref().map(|u| u.gpu),
                utilization_memory: util.as_ref().map(|u| u.memory),
                processes,
            });
        }
        if gpus.is_empty() {
            return Inventory::NoGpus {
                reason: format!("NVML lists {count} GPU(s) but none could be read"),
            };
        }
        Inventory::Gpus {
            driver: nvml.sys_driver_version().ok(),
            gpus,
        }
    }
}

impl GpuProbe for NvmlProbe {
    fn inventory(&self) -> Inventory {
        self.all()
            .restrict_to_visible(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())
    }
}
