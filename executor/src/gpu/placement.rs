//! Placing ranks on GPUs: which GPU each rank sees.
//!
//! A pure function of an [`Inventory`], the configuration, the memory each rank needs,
//! and what other executors have reserved; it never touches the GPUs, so it is tested
//! against fixed inventories. The rules (fedflow's, with a reservation ledger):
//!
//! - a GPU *fits* a load of `need` bytes when, after subtracting what other executors
//!   reserved and `need`, its free memory is at least `floor` and its used share is at
//!   most `ratio`;
//! - **per_rank**: each rank gets its own GPU. Ranks take the fitting GPUs with the
//!   *least* headroom first (best fit), leaving the roomiest GPUs for larger requests.
//!   More ranks than GPUs is a configuration error. Every rank sees the group's GPUs in
//!   rank order (`CUDA_VISIBLE_DEVICES=<uuid of rank 0>,<uuid of rank 1>,...`), so CUDA
//!   index `LOCAL_RANK` is the rank's own GPU: torchrun's convention, which
//!   `set_device(LOCAL_RANK)`, `DDP(device_ids=[local_rank])`, Lightning and Hugging
//!   Face rely on;
//! - **isolated**: placed as per_rank, but each rank sees only its own GPU
//!   (`CUDA_VISIBLE_DEVICES=<uuid>`, device `cuda:0` everywhere). The trap: scripts
//!   that call `set_device(LOCAL_RANK)` fail on every rank but 0;
//! - **shared**: every rank sees every (listed) GPU and picks one by `LOCAL_RANK`;
//!   GPU `i` carries the ranks `r` with `r % n == i`, and must fit all of them;
//! - **list**: like shared, over exactly the listed GPUs;
//! - **none**, or no GPU at all: CPU ranks (an error with `require_gpu`).

use std::collections::BTreeMap;

use super::inventory::{GpuInfo, Inventory};
use crate::config::{GpuConfig, GpuMode};
use crate::units::ByteSize;

/// Where the ranks go.
#[derive(Debug, Clone, PartialEq)]
pub enum Placement {
    /// CPU ranks.
    Cpu {
        /// Why no GPU.
        reason: String,
    },
    /// Rank `r` gets GPU `uuids[r]`.
    PerRank {
        /// One UUID per rank.
        uuids: Vec<String>,
    },
    /// Every rank sees these GPUs.
    Shared {
        /// The UUIDs.
        uuids: Vec<String>,
    },
}

impl Placement {
    /// `CUDA_VISIBLE_DEVICES` for each rank (`None`: leave it alone).
    ///
    /// In every mode but `isolated`, CUDA device index `r` within rank `r`'s list is the
    /// GPU placed for rank `r` (with fewer GPUs than ranks in `shared`, `r % n`).
    pub fn visible_devices(&self, world: u32, mode: GpuMode) -> Vec<Option<String>> {
        match self {
            Placement::Cpu { .. } if mode == GpuMode::None => {
                vec![Some(String::new()); world as usize]
            }
            Placement::Cpu { .. } => vec![None; world as usize],
            Placement::PerRank { uuids } if mode == GpuMode::Isolated => {
                uuids.iter().map(|u| Some(u.clone())).collect()
            }
            Placement::PerRank { uuids } => vec![Some(uuids.join(",")); uuids.len()],
            Placement::Shared { uuids } => vec![Some(uuids.join(",")); world as usize],
        }
    }

    /// The UUID of the GPU placed for `rank` (`None`: a CPU rank).
    pub fn gpu_of(&self, rank: u32) -> Option<&str> {
        match self {
            Placement::Cpu { .. } => None,
            Placement::PerRank { uuids } => uuids.get(rank as usize).map(String::as_str),
            Placement::Shared { uuids } if uuids.is_empty() => None,
            Placement::Shared { uuids } => Some(&uuids[rank as usize % uuids.len()]),
        }
    }

    /// A one-line description for logs.
    pub fn describe(&self) -> String {
        match self {
            Placement::Cpu { reason } => format!("CPU ranks ({reason})"),
            Placement::PerRank { uuids } => format!("one GPU per rank: {}", uuids.join(", ")),
            Placement::Shared { uuids } => format!("ranks share GPUs {}", uuids.join(", ")),
        }
    }
}

/// What placement needs to know besides the inventory.
#[derive(Debug, Clone)]
pub struct PlacementRequest<'a> {
    /// Number of ranks.
    pub world: u32,
    /// The GPU configuration.
    pub gpu: &'a GpuConfig,
    /// GPU memory each rank needs (0: no memory check).
    pub need_per_rank: u64,
    /// Used share limit.
    pub ratio: f64,
    /// Free memory floor.
    pub floor: u64,
    /// Memory other executors reserved but have not allocated yet, per UUID.
    pub reserved: &'a BTreeMap<String, u64>,
}

/// A placement that can never work with this configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// More ranks than GPUs in per-rank (or isolated) mode.
    #[error(
        "{world} ranks need {world} GPUs in per_rank mode, but only {available} are available ({list})"
    )]
    TooManyRanks {
        /// Ranks asked for.
        world: u32,
        /// GPUs available.
        available: usize,
        /// Which.
        list: String,
    },
    /// `require_gpu` with no GPU.
    #[error("require_gpu is set but there is no GPU: {reason}")]
    NoGpu {
        /// Why there is none.
        reason: String,
    },
    /// A listed device does not exist.
    #[error("gpu.devices names `{device}`, which is not one of: {known}")]
    UnknownDevice {
        /// The name given.
        device: String,
        /// The devices that exist.
        known: String,
    },
}

/// Why a placement cannot be made now (it may later, when memory frees up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotNow {
    /// What was asked, what was free, and which limit refused it.
    pub message: String,
}

fn gib(b: u64) -> String {
    ByteSize(b).to_string()
}

/// Why a GPU cannot take `need` more bytes, or `None` if it can.
fn refuses(g: &GpuInfo, need: u64, reserved: u64, ratio: f64, floor: u64) -> Option<String> {
    if need == 0 {
        return None;
    }
    let free = g.memory_free.saturating_sub(reserved);
    let after = free as i128 - need as i128;
    let what = format!(
        "GPU {} ({}) has {} free{} of {}, asked {}",
        g.index,
        g.uuid,
        gib(free),
        if reserved > 0 {
            format!(" after {} reserved by other executors", gib(reserved))
        } else {
            String::new()
        },
        gib(g.memory_total),
        gib(need)
    );
    if after < floor as i128 {
        return Some(format!(
            "{what}: refused by gpu_memory_floor {}",
            gib(floor)
        ));
    }
    let used_after = g.memory_total.saturating_sub(after as u64);
    if g.memory_total > 0 && used_after as f64 / g.memory_total as f64 > ratio {
        return Some(format!(
            "{what}: refused by gpu_memory_ratio {ratio} ({:.0}% would be in use)",
            100.0 * used_after as f64 / g.memory_total as f64
        ));
    }
    None
}

/// Places `req.world` ranks. `Err` when it can never work; `Ok(Err(NotNow))` when memory
/// is short now.
pub fn place(
    inv: &Inventory,
    req: &PlacementRequest<'_>,
) -> Result<Result<Placement, NotNow>, PlacementError> {
    if req.gpu.mode == GpuMode::None {
        return Ok(Ok(Placement::Cpu {
            reason: "gpu.mode is none".to_owned(),
        }));
    }
    let gpus = match inv {
        Inventory::NoGpus { reason } => {
            if req.gpu.require_gpu {
                return Err(PlacementError::NoGpu {
                    reason: reason.clone(),
                });
            }
            return Ok(Ok(Placement::Cpu {
                reason: reason.clone(),
            }));
        }
        Inventory::Gpus { gpus, .. } => gpus,
    };
    let known = || {
        gpus.iter()
            .map(|g| format!("{} ({})", g.index, g.uuid))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut candidates: Vec<&GpuInfo> = Vec::new();
    if req.gpu.devices.is_empty() {
        candidates.extend(gpus.iter());
    } else {
        for d in &req.gpu.devices {
            let g = gpus
                .iter()
                .find(|g| g.index.to_string() == *d || g.uuid == *d)
                .ok_or_else(|| PlacementError::UnknownDevice {
                    device: d.clone(),
                    known: known(),
                })?;
            candidates.push(g);
        }
    }
    let reserved = |g: &GpuInfo| req.reserved.get(&g.uuid).copied().unwrap_or(0);
    match req.gpu.mode {
        GpuMode::PerRank | GpuMode::Isolated => {
            if req.world as usize > candidates.len() {
                return Err(PlacementError::TooManyRanks {
                    world: req.world,
                    available: candidates.len(),
                    list: candidates
                        .iter()
                        .map(|g| format!("GPU {}", g.index))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
            let mut fitting: Vec<(&GpuInfo, u64)> = Vec::new();
            let mut refusals = Vec::new();
            for g in &candidates {
                match refuses(g, req.need_per_rank, reserved(g), req.ratio, req.floor) {
                    None => fitting.push((g, g.memory_free.saturating_sub(reserved(g)))),
                    Some(r) => refusals.push(r),
                }
            }
            if fitting.len() < req.world as usize {
                return Ok(Err(NotNow {
                    message: format!(
                        "{} ranks need one GPU each with {} free; {} of {} GPUs fit: {}",
                        req.world,
                        gib(req.need_per_rank),
                        fitting.len(),
                        candidates.len(),
                        refusals.join("; ")
                    ),
                }));
            }
            // Best fit: least headroom first, then index, for a stable answer.
            fitting.sort_by_key(|(g, free)| (*free, g.index));
            Ok(Ok(Placement::PerRank {
                uuids: fitting
                    .iter()
                    .take(req.world as usize)
                    .map(|(g, _)| g.uuid.clone())
                    .collect(),
            }))
        }
        GpuMode::Shared | GpuMode::List => {
            let n = candidates.len() as u32;
            let mut refusals = Vec::new();
            for (i, g) in candidates.iter().enumerate() {
                let ranks_here = (0..req.world).filter(|r| r % n == i as u32).count() as u64;
                if let Some(r) = refuses(
                    g,
                    req.need_per_rank * ranks_here,
                    reserved(g),
                    req.ratio,
                    req.floor,
                ) {
                    refusals.push(r);
                }
            }
            if !refusals.is_empty() {
                return Ok(Err(NotNow {
                    message: format!(
                        "{} ranks sharing {} GPUs need {} each: {}",
                        req.world,
                        n,
                        gib(req.need_per_rank),
                        refusals.join("; ")
                    ),
                }));
            }
            Ok(Ok(Placement::Shared {
                uuids: candidates.iter().map(|g| g.uuid.clone()).collect(),
            }))
        }
        GpuMode::None => unreachable!("handled above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, total_gib: u64, free_gib: u64) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            name: "Test".into(),
            memory_total: total_gib * GIB,
            memory_free: free_gib * GIB,
            memory_used: (total_gib - free_gib) * GIB,
            utilization_gpu: Some(0),
            utilization_memory: Some(0),
            processes: vec![],
        }
    }

    fn inv(gpus: Vec<GpuInfo>) -> Inventory {
        Inventory::Gpus { driver: None, gpus }
    }

    fn req<'a>(
        world: u32,
        gpu: &'a GpuConfig,
        need_gib: u64,
        reserved: &'a BTreeMap<String, u64>,
    ) -> PlacementRequest<'a> {
        PlacementRequest {
            world,
            gpu,
            need_per_rank: need_gib * GIB,
            ratio: 0.8,
            floor: 2 * GIB,
            reserved,
        }
    }

    #[test]
    fn enough_gpus_best_fit_by_free_memory() {
        let cfg = GpuConfig::default();
        let none = BTreeMap::new();
        let inv = inv(vec![gpu(0, 80, 70), gpu(1, 80, 30), gpu(2, 80, 40)]);
        let p = place(&inv, &req(2, &cfg, 8, &none)).unwrap().unwrap();
        // GPU 1 (least headroom that fits) first, then GPU 2; GPU 0 stays free.
        assert_eq!(
            p,
            Placement::PerRank {
                uuids: vec!["GPU-1".into(), "GPU-2".into()]
            }
        );
        // torchrun's numbering: every rank sees the group's GPUs in rank order, so
        // CUDA index LOCAL_RANK is the rank's own GPU.
        assert_eq!(
            p.visible_devices(2, cfg.mode),
            vec![Some("GPU-1,GPU-2".into()), Some("GPU-1,GPU-2".into())]
        );
        assert_eq!(
            (p.gpu_of(0), p.gpu_of(1), p.gpu_of(2)),
            (Some("GPU-1"), Some("GPU-2"), None)
        );
        // Isolated: the same placement, each rank sees its own GPU alone.
        let iso = GpuConfig {
            mode: GpuMode::Isolated,
            ..GpuConfig::default()
        };
        let q = place(&inv, &req(2, &iso, 8, &none)).unwrap().unwrap();
        assert_eq!(q, p);
        assert_eq!(
            q.visible_devices(2, iso.mode),
            vec![Some("GPU-1".into()), Some("GPU-2".into())]
        );
    }

    #[test]
    fn local_rank_indexes_the_placed_gpu_for_1_to_8_ranks() {
        // Eight GPUs of distinct free memory: best fit orders them by headroom, which is
        // neither the index order nor its reverse.
        let free = [70, 24, 38, 18, 46, 30, 62, 54];
        let inv = inv(free
            .iter()
            .enumerate()
            .map(|(i, f)| gpu(i as u32, 80, *f))
            .collect());
        let none = BTreeMap::new();
        let mut by_headroom: Vec<usize> = (0..8).collect();
        by_headroom.sort_by_key(|i| free[*i]);
        for world in 1..=8u32 {
            for mode in [GpuMode::PerRank, GpuMode::Isolated] {
                let cfg = GpuConfig {
                    mode,
                    ..GpuConfig::default()
                };
                let p = place(&inv, &req(world, &cfg, 1, &none)).unwrap().unwrap();
                let visible = p.visible_devices(world, mode);
                assert_eq!(visible.len(), world as usize);
                for (rank, list) in visible.iter().enumerate() {
                    let want = format!("GPU-{}", by_headroom[rank]);
                    assert_eq!(p.gpu_of(rank as u32), Some(want.as_str()));
                    let list: Vec<&str> = list.as_deref().unwrap().split(',').collect();
                    let local_rank = if mode == GpuMode::Isolated { 0 } else { rank };
                    assert_eq!(
                        list[local_rank], want,
                        "{world} ranks, {mode:?}, rank {rank}"
                    );
                }
            }
        }
    }

    #[test]
    fn too_little_memory_waits_with_a_reason() {
        let cfg = GpuConfig::default();
        let none = BTreeMap::new();
        let inv = inv(vec![gpu(0, 80, 70), gpu(1, 80, 9)]);
        let not_now = place(&inv, &req(2, &cfg, 8, &none)).unwrap().unwrap_err();
        assert!(
            not_now.message.contains("1 of 2 GPUs fit"),
            "{}",
            not_now.message
        );
        assert!(
            not_now.message.contains("GPU 1 (GPU-1) has 9.0 GiB free of 80.0 GiB, asked 8.0 GiB: refused by gpu_memory_floor 2.0 GiB"),
            "{}",
            not_now.message
        );
    }

    #[test]
    fn reservations_by_other_executors_count() {
        let cfg = GpuConfig::default();
        let mut reserved = BTreeMap::new();
        reserved.insert("GPU-0".to_string(), 40 * GIB);
        let inv = inv(vec![gpu(0, 80, 70)]);
        let not_now = place(&inv, &req(1, &cfg, 16, &reserved))
            .unwrap()
            .unwrap_err();
        assert!(
            not_now
                .message
                .contains("has 30.0 GiB free after 40.0 GiB reserved by other executors"),
            "{}",
            not_now.message
        );
        assert!(place(&inv, &req(1, &cfg, 4, &reserved)).unwrap().is_ok());
    }

    #[test]
    fn ratio_limit_refuses() {
        let cfg = GpuConfig::default();
        let none = BTreeMap::new();
        // 80 GiB card, 30 free: taking 20 leaves 10 free (floor ok) but 87.5% used.
        let inv = inv(vec![gpu(0, 80, 30)]);
        let not_now = place(&inv, &req(1, &cfg, 20, &none)).unwrap().unwrap_err();
        assert!(
            not_now.message.contains("refused by gpu_memory_ratio 0.8"),
            "{}",
            not_now.message
        );
    }

    #[test]
    fn more_ranks_than_gpus_is_a_configuration_error() {
        let cfg = GpuConfig::default();
        let none = BTreeMap::new();
        let inv = inv(vec![gpu(0, 80, 70), gpu(1, 80, 70)]);
        let err = place(&inv, &req(4, &cfg, 0, &none)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "4 ranks need 4 GPUs in per_rank mode, but only 2 are available (GPU 0, GPU 1)"
        );
    }

    #[test]
    fn no_gpus_means_cpu_ranks_unless_required() {
        let none = BTreeMap::new();
        let inv = Inventory::NoGpus {
            reason: "NVML is unavailable (test)".into(),
        };
        let cfg = GpuConfig::default();
        let p = place(&inv, &req(4, &cfg, 8, &none)).unwrap().unwrap();
        assert_eq!(
            p,
            Placement::Cpu {
                reason: "NVML is unavailable (test)".into()
            }
        );
        assert_eq!(p.visible_devices(4, cfg.mode), vec![None; 4]);
        let required = GpuConfig {
            require_gpu: true,
            ..GpuConfig::default()
        };
        let err = place(&inv, &req(1, &required, 0, &none)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "require_gpu is set but there is no GPU: NVML is unavailable (test)"
        );
    }

    #[test]
    fn uneven_shared_and_list_modes() {
        let none = BTreeMap::new();
        let inv = inv(vec![gpu(0, 80, 70), gpu(1, 16, 10)]);
        let shared = GpuConfig {
            mode: GpuMode::Shared,
            ..GpuConfig::default()
        };
        // 3 ranks on 2 GPUs: GPU 0 takes ranks 0 and 2 (2x4 GiB), GPU 1 takes rank 1.
        let p = place(&inv, &req(3, &shared, 4, &none)).unwrap().unwrap();
        assert_eq!(
            p.visible_devices(3, shared.mode),
            vec![Some("GPU-0,GPU-1".into()); 3]
        );
        // 4 GiB leaves 6 GiB on GPU 1 (62% used): fine. 7 GiB would leave 3 GiB but 81% used.
        let not_now = place(&inv, &req(3, &shared, 7, &none))
            .unwrap()
            .unwrap_err();
        assert!(not_now.message.contains("GPU 1"), "{}", not_now.message);
        let list = GpuConfig {
            mode: GpuMode::List,
            devices: vec!["GPU-1".into()],
            require_gpu: false,
        };
        assert_eq!(
            place(&inv, &req(2, &list, 0, &none)).unwrap().unwrap(),
            Placement::Shared {
                uuids: vec!["GPU-1".into()]
            }
        );
        let bad = GpuConfig {
            mode: GpuMode::List,
            devices: vec!["7".into()],
            require_gpu: false,
        };
        assert!(matches!(
            place(&inv, &req(1, &bad, 0, &none)),
            Err(PlacementError::UnknownDevice { .. })
        ));
    }

    #[test]
    fn host_visible_devices_restrict_the_inventory() {
        let inv = inv(vec![gpu(0, 80, 70), gpu(1, 80, 70), gpu(2, 80, 70)]);
        let r = inv.clone().restrict_to_visible(Some("2,GPU-0"));
        assert_eq!(r.gpus().iter().map(|g| g.index).collect::<Vec<_>>(), [0, 2]);
        let none = inv.restrict_to_visible(Some("9"));
        assert!(matches!(none, Inventory::NoGpus { .. }));
    }
}
