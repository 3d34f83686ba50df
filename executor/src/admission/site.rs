//! Site reservations: GPUs that a scheduler outside rankexec promises a whole job.
//!
//! NVIDIA FLARE admits a job on a site through the site's resource manager
//! (`rankexec.flare.resources`): the job asks for `num_of_gpus` GPUs with
//! `mem_per_gpu_in_GiB` each. [`reserve_gpus`] answers with rankexec's own rules, so
//! there is one authority per host: the GPUs are placed as [`crate::gpu::place`]
//! places ranks in `per_rank` mode (one GPU per requested GPU, best fit, the memory
//! ratio and floor), against the same inventory, and the reservation is an entry of
//! the host's [`Ledger`], which every rankexec executor on the host reads.
//!
//! The entry is held by the calling process (the FLARE client): it is removed when the
//! [`Reservation`] is dropped (the job ended and the manager freed it), and dropped by
//! the next transaction when that process is gone (the ledger's reclaim).
//!
//! Inside the job, the ranks run *within* the grant: a job process whose environment
//! names the entry in [`GRANT_ENV`] does not count it against its own groups (its
//! groups' admissions skip it), else a group asking for the memory its job was granted
//! would be refused by its own grant.
//!
//! Caveat: a group inside a grant that also reserves memory (`resources.gpu_memory`)
//! adds an entry of its own; other executors on the host then count both (too much,
//! never too little) until one is gone.

use std::collections::BTreeMap;

use super::host;
use super::ledger::{self, Entry, Ledger, LedgerError, Reservation};
use crate::config::{GpuConfig, GpuMode};
use crate::gpu::{GpuInfo, Inventory, Placement, PlacementError, PlacementRequest, place};

/// The variable that names, in a job's environment, the ledger entry its GPUs come
/// from (set by the site's resource consumer).
pub const GRANT_ENV: &str = "RANKEXEC_GPU_GRANT";

/// What a job asks of a site.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SiteRequest {
    /// Number of GPUs (at least 1).
    pub num_gpus: u32,
    /// Memory on each, bytes (0: no memory check; the GPUs can be shared).
    pub mem_per_gpu: u64,
    /// Used share limit of a GPU after the reservation.
    pub ratio: f64,
    /// Free memory a GPU must keep after the reservation, bytes.
    pub floor: u64,
}

/// The answer to a [`SiteRequest`].
#[derive(Debug)]
pub enum SiteDecision {
    /// Reserved: these GPUs (UUIDs, or indices for a declared inventory), held until
    /// the reservation is dropped.
    Granted {
        /// The GPUs, in placement order.
        uuids: Vec<String>,
        /// The ledger entry.
        reservation: Reservation,
    },
    /// Not reserved.
    Refused {
        /// What was asked, what is there, and which limit refused it.
        reason: String,
        /// True when the request can never be met on this site (too many GPUs, too
        /// much memory for any GPU, no GPU at all), not only now.
        never: bool,
    },
}

/// Memory reserved by `others` that their ranks have not allocated yet: per GPU UUID,
/// and on the host. A reservation counts `max(0, reserved - measured)`, where measured
/// is the ranks' NVML-reported usage (GPU) or resident memory (host).
pub(crate) fn outstanding(inventory: &Inventory, others: &[Entry]) -> (BTreeMap<String, u64>, u64) {
    let mut gpu: BTreeMap<String, u64> = BTreeMap::new();
    let mut host_bytes = 0u64;
    for e in others {
        let measured: u64 = e.rank_pids.iter().map(|p| host::rss(*p)).sum();
        host_bytes += e.host.saturating_sub(measured);
        for (uuid, bytes) in &e.gpu {
            let used: u64 = inventory
                .gpus()
                .iter()
                .filter(|g| &g.uuid == uuid)
                .flat_map(|g| g.processes.iter())
                .filter(|(pid, _)| e.rank_pids.contains(pid))
                .filter_map(|(_, u)| *u)
                .sum();
            *gpu.entry(uuid.clone()).or_default() += bytes.saturating_sub(used);
        }
    }
    (gpu, host_bytes)
}

fn never_message(e: &PlacementError) -> String {
    match e {
        PlacementError::TooManyRanks {
            world,
            available,
            list,
        } => format!("the job asks for {world} GPUs; this site has {available} ({list})"),
        PlacementError::NoGpu { reason } => {
            format!("the job asks for GPUs; this site has none ({reason})")
        }
        other => rankexec_protocol::error_chain(other),
    }
}

/// Reserves `req.num_gpus` GPUs of `inventory` for a job, as entry `id` of `ledger`
/// (see the module doc). `Err` only when the ledger cannot be used.
pub fn reserve_gpus(
    inventory: &Inventory,
    ledger: &Ledger,
    req: &SiteRequest,
    id: &str,
) -> Result<SiteDecision, LedgerError> {
    let cfg = GpuConfig {
        mode: GpuMode::PerRank,
        devices: Vec::new(),
        require_gpu: true,
    };
    fn request<'a>(
        req: &SiteRequest,
        cfg: &'a GpuConfig,
        reserved: &'a BTreeMap<String, u64>,
    ) -> PlacementRequest<'a> {
        PlacementRequest {
            world: req.num_gpus,
            gpu: cfg,
            need_per_rank: req.mem_per_gpu,
            ratio: req.ratio,
            floor: req.floor,
            reserved,
        }
    }
    // Could it fit on this site's GPUs if every one were idle?
    let idle = match inventory {
        Inventory::Gpus { driver, gpus } => Inventory::Gpus {
            driver: driver.clone(),
            gpus: gpus
                .iter()
                .map(|g| GpuInfo {
                    memory_free: g.memory_total,
                    memory_used: 0,
                    processes: Vec::new(),
                    ..g.clone()
                })
                .collect(),
        },
        none => none.clone(),
    };
    let nothing = BTreeMap::new();
    match place(&idle, &request(req, &cfg, &nothing)) {
        Err(e) => {
            return Ok(SiteDecision::Refused {
                reason: never_message(&e),
                never: true,
            });
        }
        Ok(Err(not_now)) => {
            return Ok(SiteDecision::Refused {
                reason: format!("never fits, even on idle GPUs: {}", not_now.message),
                never: true,
            });
        }
        Ok(Ok(_)) => {}
    }
    let decided = ledger.transaction(|others| {
        let (reserved, _) = outstanding(inventory, others);
        let uuids = match place(inventory, &request(req, &cfg, &reserved)) {
            Ok(Ok(Placement::PerRank { uuids })) => uuids,
            Ok(Ok(other)) => return Err(format!("unexpected placement: {}", other.describe())),
            Ok(Err(not_now)) => {
                // Placement speaks of ranks; a site request is GPUs for a job.
                let ranks = format!("{} ranks need one GPU each with ", req.num_gpus);
                let message = match not_now.message.strip_prefix(&ranks) {
                    Some(rest) => format!("the job asks for {} GPUs with {rest}", req.num_gpus),
                    None => not_now.message,
                };
                return Err(format!("not now: {message}"));
            }
            Err(e) => return Err(never_message(&e)),
        };
        let pid = std::process::id();
        let entry = Entry {
            id: id.to_owned(),
            pid,
            start: ledger::start_time(pid).unwrap_or(0),
            host: 0,
            gpu: uuids.iter().map(|u| (u.clone(), req.mem_per_gpu)).collect(),
            rank_pids: Vec::new(),
        };
        Ok((uuids, Some(entry)))
    })?;
    Ok(match decided {
        Ok((uuids, Some(reservation))) => SiteDecision::Granted { uuids, reservation },
        Ok((_, None)) => SiteDecision::Refused {
            reason: "no reservation was recorded".into(),
            never: false,
        },
        Err(reason) => SiteDecision::Refused {
            reason,
            never: false,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::parse_fixed;

    const GIB: u64 = 1 << 30;

    fn req(num_gpus: u32, mem_gib: u64) -> SiteRequest {
        SiteRequest {
            num_gpus,
            mem_per_gpu: mem_gib * GIB,
            ratio: 0.8,
            floor: 2 * GIB,
        }
    }

    fn granted(d: SiteDecision) -> (Vec<String>, Reservation) {
        match d {
            SiteDecision::Granted { uuids, reservation } => (uuids, reservation),
            SiteDecision::Refused { reason, .. } => panic!("refused: {reason}"),
        }
    }

    fn refused(d: SiteDecision) -> (String, bool) {
        match d {
            SiteDecision::Refused { reason, never } => (reason, never),
            SiteDecision::Granted { uuids, .. } => panic!("granted {uuids:?}"),
        }
    }

    #[test]
    fn two_jobs_of_two_gpus_take_turns_on_a_two_gpu_site() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join("ledger.json"));
        let inv = parse_fixed("2x16GiB").unwrap();
        let (uuids, first) = granted(reserve_gpus(&inv, &ledger, &req(2, 8), "a").unwrap());
        assert_eq!(uuids, ["0", "1"]);
        let (reason, never) = refused(reserve_gpus(&inv, &ledger, &req(2, 8), "b").unwrap());
        assert!(!never);
        assert!(
            reason.starts_with("not now: the job asks for 2 GPUs with 8.0 GiB free; 0 of 2 GPUs fit: GPU 0 (0) has 8.0 GiB free after 8.0 GiB reserved by other executors"),
            "{reason}"
        );
        drop(first);
        let (uuids, _second) = granted(reserve_gpus(&inv, &ledger, &req(2, 8), "b").unwrap());
        assert_eq!(uuids, ["0", "1"]);
        assert_eq!(ledger.entries().unwrap()[0].id, "b");
    }

    #[test]
    fn requests_that_never_fit_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join("ledger.json"));
        let inv = parse_fixed("2x16GiB").unwrap();
        let (reason, never) = refused(reserve_gpus(&inv, &ledger, &req(3, 8), "c").unwrap());
        assert!(never);
        assert_eq!(
            reason,
            "the job asks for 3 GPUs; this site has 2 (GPU 0, GPU 1)"
        );
        let (reason, never) = refused(reserve_gpus(&inv, &ledger, &req(1, 15), "d").unwrap());
        assert!(never, "{reason}");
        assert!(
            reason.starts_with("never fits, even on idle GPUs"),
            "{reason}"
        );
        let none = parse_fixed("none").unwrap();
        let (reason, never) = refused(reserve_gpus(&none, &ledger, &req(1, 0), "e").unwrap());
        assert!(never);
        assert!(reason.contains("this site has none"), "{reason}");
        assert!(ledger.entries().unwrap().is_empty());
    }

    #[test]
    fn a_group_inside_its_grant_does_not_count_it() {
        use super::super::host::{FixedHost, HostMemory};
        use super::super::{Admission, Admit};
        use crate::config::ExecutorConfig;
        use crate::gpu::FixedInventory;
        use std::sync::Arc;

        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join("ledger.json"));
        let inv = parse_fixed("2x16GiB").unwrap();
        let (_, _grant) = granted(reserve_gpus(&inv, &ledger, &req(2, 8), "grant").unwrap());
        let mut c = ExecutorConfig::simple(2, "Echo", serde_json::Value::Null);
        c.resources.gpu_memory = Some("8GiB".parse().unwrap());
        let cfg = Arc::new(c);
        let host = Arc::new(FixedHost {
            memory: HostMemory {
                total: 64 * GIB,
                available: 60 * GIB,
            },
            cpu: None,
        });
        let gpus = Arc::new(FixedInventory(inv));
        let mut outside =
            Admission::with_probes(cfg.clone(), gpus.clone(), host.clone(), ledger.clone());
        let Admit::Wait(r) = outside.try_admit(1.0).unwrap() else {
            panic!("another executor must count the grant")
        };
        assert!(
            r.message.contains("reserved by other executors"),
            "{}",
            r.message
        );
        let mut inside = Admission::with_probes(cfg, gpus, host, ledger.clone())
            .within_grant(Some("grant".into()));
        let Admit::Granted(g) = inside.try_admit(1.0).unwrap() else {
            panic!("the grant's own group must fit in it")
        };
        let devs: Vec<_> = g
            .per_rank
            .iter()
            .map(|m| m["CUDA_VISIBLE_DEVICES"].clone())
            .collect();
        assert_eq!(devs, ["0,1", "0,1"], "torchrun numbering inside the grant");
    }
}
