//! Admission: may this group start now, and on which GPUs?
//!
//! fedflow's rules done right. Each resource with a per-rank estimate is checked against
//! a ratio limit and an absolute floor; GPUs are placed by [`crate::gpu::place`]; a CPU
//! limit can hold starts while the host is busy. Estimates grow by `oom_growth` after
//! each out-of-memory retry. Decisions run as transactions on the host's
//! [`Ledger`], so two executors on one machine never count the same free memory.
//! When the request cannot be met now, the dispatcher re-checks every half second until
//! the admission deadline, then fails with what was asked, what was free, and which
//! limit refused it.
//!
//! - [`host`]: host memory and CPU.
//! - [`ledger`]: the reservation ledger.
//! - [`ports`]: the group's rendezvous port (`MASTER_PORT`), reserved among this
//!   user's executors for the group's life.
//! - [`site`]: GPUs reserved for a whole job by a site's scheduler (FLARE's resource
//!   manager); a group inside such a grant (`RANKEXEC_GPU_GRANT`) does not count it.

pub mod host;
pub mod ledger;
pub mod ports;
pub mod site;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{ExecutorConfig, GpuMode};
use crate::gpu::{
    GpuProbe, Inventory, NvmlProbe, Placement, PlacementError, PlacementRequest, place,
};
use crate::units::ByteSize;
use host::{HostProbe, SysinfoHost};
use ledger::{Entry, Ledger, Reservation};

/// Why a group may not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// The GPU configuration can never be met.
    #[error("gpu placement")]
    Placement(#[from] PlacementError),
    /// Resources stayed short until the deadline.
    #[error("not admitted within {waited:?}: {message}")]
    Refused {
        /// What was asked, what was free, and which limit refused it.
        message: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The ledger could not be read or written.
    #[error("reservation ledger {path}: {message}")]
    Ledger {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
}

/// Resources are short now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What was asked, what was free, and which limit refused it.
    pub message: String,
}

impl Refusal {
    /// The final error after waiting `waited`.
    pub fn into_error(self, waited: Duration) -> AdmissionError {
        AdmissionError::Refused {
            message: self.message,
            waited,
        }
    }
}

/// What an admitted group gets.
#[derive(Debug, Default)]
pub struct Grant {
    /// Extra environment per rank (`CUDA_VISIBLE_DEVICES`).
    pub per_rank: Vec<BTreeMap<String, String>>,
    /// Extra environment for every process (external launchers).
    pub common: BTreeMap<String, String>,
    /// The placement, for logs.
    pub placement: Option<Placement>,
    /// The ledger entry, released when the group stops.
    pub reservation: Option<Reservation>,
    /// The rendezvous port, kept from other executors of this user until the group
    /// stops.
    pub master_port: Option<ports::PortLease>,
}

/// The outcome of one admission attempt.
#[derive(Debug)]
pub enum Admit {
    /// Start now.
    Granted(Grant),
    /// Not now.
    Wait(Refusal),
}

/// Admission for one executor.
pub struct Admission {
    cfg: Arc<ExecutorConfig>,
    gpus: Arc<dyn GpuProbe>,
    host: Arc<dyn HostProbe>,
    ledger: Ledger,
    seq: u64,
    /// The ledger entry this group's job was granted (see [`site`]), if any.
    grant: Option<String>,
}

fn text(b: u64) -> String {
    ByteSize(b).to_string()
}

impl Admission {
    /// Admission with the real probes (NVML, sysinfo), the user's ledger, and the
    /// site grant named by `RANKEXEC_GPU_GRANT`, if any.
    pub fn new(cfg: Arc<ExecutorConfig>) -> Self {
        Self::with_probes(
            cfg,
            Arc::new(NvmlProbe),
            Arc::new(SysinfoHost::new()),
            Ledger::default_for_user(),
        )
        .within_grant(
            std::env::var(site::GRANT_ENV)
                .ok()
                .filter(|g| !g.is_empty()),
        )
    }

    /// Runs the group inside a site grant: the ledger entry `grant` is not counted as
    /// another executor's reservation.
    pub fn within_grant(mut self, grant: Option<String>) -> Self {
        self.grant = grant;
        self
    }

    /// Admission with given probes and ledger.
    pub fn with_probes(
        cfg: Arc<ExecutorConfig>,
        gpus: Arc<dyn GpuProbe>,
        host: Arc<dyn HostProbe>,
        ledger: Ledger,
    ) -> Self {
        Admission {
            cfg,
            gpus,
            host,
            ledger,
            seq: 0,
            grant: None,
        }
    }

    fn inventory(&self) -> Inventory {
        if self.cfg.gpu.mode == GpuMode::None {
            Inventory::NoGpus {
                reason: "gpu.mode is none".into(),
            }
        } else {
            self.gpus.inventory()
        }
    }

    /// Tries to admit the group, with estimates multiplied by `growth`.
    pub fn try_admit(&mut self, growth: f64) -> Result<Admit, AdmissionError> {
        let r = &self.cfg.resources;
        let world = self.cfg.num_of_processes;
        let grow = |b: Option<ByteSize>| b.map(|b| (b.bytes() as f64 * growth) as u64);
        let need_host = grow(r.host_memory);
        let need_gpu = grow(r.gpu_memory).unwrap_or(0);
        let inventory = self.inventory();
        if let Some(limit) = r.cpu_limit
            && let Some(usage) = self.host.cpu_usage()
            && usage > limit
        {
            return Ok(Admit::Wait(Refusal {
                message: format!(
                    "host CPU utilization is {:.0}%: refused by cpu_limit {:.0}%",
                    usage * 100.0,
                    limit * 100.0
                ),
            }));
        }
        let needs_ledger = need_host.is_some() || need_gpu > 0;
        self.seq += 1;
        let seq = self.seq;
        let decide = |others: &[Entry]| -> Result<(Placement, Option<Entry>), Refusal> {
            // A group inside its job's site grant draws on it: the grant is not "other".
            let others: Vec<Entry> = others
                .iter()
                .filter(|e| self.grant.as_deref() != Some(e.id.as_str()))
                .cloned()
                .collect();
            let (reserved_gpu, reserved_host) = site::outstanding(&inventory, &others);
            let req = PlacementRequest {
                world,
                gpu: &self.cfg.gpu,
                need_per_rank: need_gpu,
                ratio: r.gpu_memory_ratio,
                floor: r.gpu_memory_floor.bytes(),
                reserved: &reserved_gpu,
            };
            let placement = match place(&inventory, &req) {
                Ok(Ok(p)) => p,
                Ok(Err(not_now)) => {
                    return Err(Refusal {
                        message: not_now.message,
                    });
                }
                // Configuration errors are raised before the transaction (see below).
                Err(e) => {
                    return Err(Refusal {
                        message: rankexec_protocol::error_chain(&e),
                    });
                }
            };
            if let Some(per_rank) = need_host {
                let m = self.host.memory();
                let need = per_rank * u64::from(world);
                let free = m.available.saturating_sub(reserved_host);
                let after = free as i128 - need as i128;
                let asked = format!(
                    "{world} ranks x {} = {} host memory; {} available{} of {}",
                    text(per_rank),
                    text(need),
                    text(free),
                    if reserved_host > 0 {
                        format!(" after {} reserved by other executors", text(reserved_host))
                    } else {
                        String::new()
                    },
                    text(m.total)
                );
                if after < r.memory_floor.bytes() as i128 {
                    return Err(Refusal {
                        message: format!(
                            "{asked}: refused by memory_floor {}",
                            text(r.memory_floor.bytes())
                        ),
                    });
                }
                let used_after = m.total.saturating_sub(after as u64);
                if m.total > 0 && used_after as f64 / m.total as f64 > r.memory_ratio {
                    return Err(Refusal {
                        message: format!(
                            "{asked}: refused by memory_ratio {} ({:.0}% would be in use)",
                            r.memory_ratio,
                            100.0 * used_after as f64 / m.total as f64
                        ),
                    });
                }
            }
            let entry = needs_ledger.then(|| {
                let pid = std::process::id();
                let mut gpu = BTreeMap::new();
                if need_gpu > 0 {
                    for uuid in (0..world).filter_map(|r| placement.gpu_of(r)) {
                        *gpu.entry(uuid.to_owned()).or_default() += need_gpu;
                    }
                }
                Entry {
                    id: format!("{pid}-{}-{seq}", self.cfg.executor_id),
                    pid,
                    start: ledger::start_time(pid).unwrap_or(0),
                    host: need_host.map_or(0, |h| h * u64::from(world)),
                    gpu,
                    rank_pids: Vec::new(),
                }
            });
            Ok((placement, entry))
        };
        // Impossible configurations are errors, not waits.
        let probe_req = PlacementRequest {
            world,
            gpu: &self.cfg.gpu,
            need_per_rank: 0,
            ratio: 1.0,
            floor: 0,
            reserved: &BTreeMap::new(),
        };
        let _possible = place(&inventory, &probe_req)?;
        let decided = if needs_ledger {
            self.ledger
                .transaction(decide)
                .map_err(|e| AdmissionError::Ledger {
                    path: self.ledger.path().display().to_string(),
                    message: rankexec_protocol::error_chain(&e),
                })?
        } else {
            decide(&[]).map(|(p, _)| (p, None))
        };
        let (placement, reservation) = match decided {
            Ok(x) => x,
            Err(refusal) => return Ok(Admit::Wait(refusal)),
        };
        let visible = placement.visible_devices(world, self.cfg.gpu.mode);
        let per_rank = visible
            .iter()
            .map(|v| {
                v.iter()
                    .map(|d| ("CUDA_VISIBLE_DEVICES".to_owned(), d.clone()))
                    .collect()
            })
            .collect();
        let mut common = BTreeMap::new();
        // External launchers start every rank with one environment: they see the
        // union of the group's GPUs and pick by LOCAL_RANK.
        if !matches!(self.cfg.launcher, crate::config::LauncherConfig::Builtin) {
            match &placement {
                Placement::PerRank { uuids } | Placement::Shared { uuids } => {
                    common.insert("CUDA_VISIBLE_DEVICES".to_owned(), uuids.join(","));
                }
                Placement::Cpu { .. } if self.cfg.gpu.mode == GpuMode::None => {
                    common.insert("CUDA_VISIBLE_DEVICES".to_owned(), String::new());
                }
                Placement::Cpu { .. } => {}
            }
        }
        let master_port = ports::reserve();
        tracing::info!(placement = %placement.describe(), master_port = master_port.port(), "admitted");
        Ok(Admit::Granted(Grant {
            per_rank,
            common,
            placement: Some(placement),
            reservation,
            master_port: Some(master_port),
        }))
    }
}

/// Checks at load time that a configuration can ever be placed on this host's GPUs.
pub fn check_placement(
    cfg: &ExecutorConfig,
    gpus: &dyn GpuProbe,
) -> Result<Placement, AdmissionError> {
    let inventory = if cfg.gpu.mode == GpuMode::None {
        Inventory::NoGpus {
            reason: "gpu.mode is none".into(),
        }
    } else {
        gpus.inventory()
    };
    let req = PlacementRequest {
        world: cfg.num_of_processes,
        gpu: &cfg.gpu,
        need_per_rank: 0,
        ratio: 1.0,
        floor: 0,
        reserved: &BTreeMap::new(),
    };
    match place(&inventory, &req)? {
        Ok(p) => Ok(p),
        Err(n) => Err(AdmissionError::Refused {
            message: n.message,
            waited: Duration::ZERO,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::host::{FixedHost, HostMemory};
    use super::*;
    use crate::gpu::{FixedInventory, GpuInfo};

    const GIB: u64 = 1 << 30;

    fn cfg(n: u32, host: Option<&str>, gpu: Option<&str>) -> Arc<ExecutorConfig> {
        let mut c = ExecutorConfig::simple(n, "Echo", serde_json::Value::Null);
        c.resources.host_memory = host.map(|s| s.parse().unwrap());
        c.resources.gpu_memory = gpu.map(|s| s.parse().unwrap());
        Arc::new(c)
    }

    fn host(total_gib: u64, avail_gib: u64) -> Arc<FixedHost> {
        Arc::new(FixedHost {
            memory: HostMemory {
                total: total_gib * GIB,
                available: avail_gib * GIB,
            },
            cpu: Some(0.1),
        })
    }

    fn no_gpus() -> Arc<FixedInventory> {
        Arc::new(FixedInventory(Inventory::NoGpus {
            reason: "test machine".into(),
        }))
    }

    fn ledger() -> (tempfile::TempDir, Ledger) {
        let d = tempfile::tempdir().unwrap();
        let l = Ledger::at(d.path().join("ledger.json"));
        (d, l)
    }

    #[test]
    fn host_memory_enough_and_too_little() {
        let (_d, l) = ledger();
        let mut ok = Admission::with_probes(
            cfg(2, Some("4GiB"), None),
            no_gpus(),
            host(50, 43),
            l.clone(),
        );
        let Admit::Granted(g) = ok.try_admit(1.0).unwrap() else {
            panic!("should admit")
        };
        assert!(g.reservation.is_some());
        // Another executor now sees 8 GiB reserved: 43 - 8 - 2x16 = 3 < floor 4.
        let mut second = Admission::with_probes(
            cfg(2, Some("16GiB"), None),
            no_gpus(),
            host(50, 43),
            l.clone(),
        );
        let Admit::Wait(refusal) = second.try_admit(1.0).unwrap() else {
            panic!("should wait")
        };
        assert_eq!(
            refusal.message,
            "2 ranks x 16.0 GiB = 32.0 GiB host memory; 35.0 GiB available after 8.0 GiB reserved by other executors of 50.0 GiB: refused by memory_floor 4.0 GiB"
        );
        drop(g);
        let Admit::Granted(_) = second.try_admit(1.0).unwrap() else {
            panic!("released reservation frees memory")
        };
    }

    #[test]
    fn ratio_and_growth() {
        let (_d, l) = ledger();
        // 100 GiB total, 50 available: 2 x 10 GiB leaves 30 (floor ok) but 70% used: ok at ratio 0.8.
        let mut a = Admission::with_probes(
            cfg(2, Some("10GiB"), None),
            no_gpus(),
            host(100, 50),
            l.clone(),
        );
        assert!(matches!(a.try_admit(1.0).unwrap(), Admit::Granted(_)));
        // After an OOM retry at growth 1.5: 2 x 15 leaves 20: 80% used is still ok; 1.6 is not.
        let (_d2, l2) = ledger();
        let mut b =
            Admission::with_probes(cfg(2, Some("10GiB"), None), no_gpus(), host(100, 50), l2);
        let Admit::Wait(r) = b.try_admit(1.6).unwrap() else {
            panic!("grown estimate must wait")
        };
        assert!(
            r.message.contains("refused by memory_ratio 0.8"),
            "{}",
            r.message
        );
    }

    #[test]
    fn gpu_placement_env_and_config_errors() {
        let (_d, l) = ledger();
        let gpus = Arc::new(FixedInventory(Inventory::Gpus {
            driver: Some("test".into()),
            gpus: (0..2)
                .map(|i| GpuInfo {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    name: "T".into(),
                    memory_total: 80 * GIB,
                    memory_free: 60 * GIB,
                    memory_used: 20 * GIB,
                    utilization_gpu: None,
                    utilization_memory: None,
                    processes: vec![],
                })
                .collect(),
        }));
        let mut a = Admission::with_probes(
            cfg(2, None, Some("8GiB")),
            gpus.clone(),
            host(64, 40),
            l.clone(),
        );
        let Admit::Granted(g) = a.try_admit(1.0).unwrap() else {
            panic!()
        };
        let devs: Vec<_> = g
            .per_rank
            .iter()
            .map(|m| m["CUDA_VISIBLE_DEVICES"].clone())
            .collect();
        // torchrun's numbering: both see both, in rank order.
        assert_eq!(devs, ["GPU-0,GPU-1", "GPU-0,GPU-1"]);
        let entries = l.entries().unwrap();
        assert_eq!(entries[0].gpu.values().sum::<u64>(), 16 * GIB);
        assert_eq!(
            entries[0].gpu.get("GPU-1"),
            Some(&(8 * GIB)),
            "one rank's share each"
        );
        let mut too_many =
            Admission::with_probes(cfg(3, None, None), gpus.clone(), host(64, 40), l.clone());
        assert!(matches!(
            too_many.try_admit(1.0),
            Err(AdmissionError::Placement(
                PlacementError::TooManyRanks { .. }
            ))
        ));
        assert!(check_placement(&cfg(3, None, None), gpus.as_ref()).is_err());
    }

    #[test]
    fn cpu_limit_refuses_a_busy_host() {
        let (_d, l) = ledger();
        let mut c = ExecutorConfig::simple(1, "Echo", serde_json::Value::Null);
        c.resources.cpu_limit = Some(0.5);
        let busy = Arc::new(FixedHost {
            memory: HostMemory {
                total: GIB,
                available: GIB,
            },
            cpu: Some(0.9),
        });
        let mut a = Admission::with_probes(Arc::new(c), no_gpus(), busy, l);
        let Admit::Wait(r) = a.try_admit(1.0).unwrap() else {
            panic!()
        };
        assert_eq!(
            r.message,
            "host CPU utilization is 90%: refused by cpu_limit 50%"
        );
    }
}
