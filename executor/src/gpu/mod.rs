//! GPUs: inventory through NVML and placement of ranks.
//!
//! - [`inventory`]: [`Inventory`], [`GpuInfo`], the [`GpuProbe`] trait, and a site's
//!   declared inventory ([`parse_fixed`], `RANKEXEC_GPU_INVENTORY`).
//! - [`nvml`]: [`NvmlProbe`], which degrades to "no GPUs" with NVML's reason.
//! - [`placement`]: where each rank goes ([`place`]).

pub mod inventory;
pub mod nvml;
pub mod placement;

pub use inventory::{
    FixedInventory, GpuInfo, GpuProbe, INVENTORY_ENV, Inventory, InventorySpecError, parse_fixed,
};
pub use nvml::NvmlProbe;
pub use placement::{NotNow, Placement, PlacementError, PlacementRequest, place};
