//! Host memory and CPU, through sysinfo.
//!
//! Free memory is `MemAvailable` (what a new process can get without swapping), capped
//! by the cgroup's limit when the host runs in a container. CPU utilization needs two
//! samples 200 ms apart (`sysinfo::MINIMUM_CPU_UPDATE_INTERVAL`), so it is measured only
//! when a CPU limit is configured.

use std::sync::{Mutex, PoisonError};

use sysinfo::System;

/// Host memory, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// Total memory (or the cgroup's limit).
    pub total: u64,
    /// Memory available to new work.
    pub available: u64,
}

/// A source of host facts.
pub trait HostProbe: Send + Sync {
    /// Memory now.
    fn memory(&self) -> HostMemory;
    /// CPU utilization now, 0..1 (takes a short sampling interval).
    fn cpu_usage(&self) -> Option<f64>;
}

/// Reads the host through sysinfo.
pub struct SysinfoHost {
    sys: Mutex<Option<System>>,
}

impl SysinfoHost {
    /// A probe; sysinfo failing to initialize makes every reading "unknown" (0).
    pub fn new() -> Self {
        SysinfoHost {
            sys: Mutex::new(System::new().ok()),
        }
    }
}

impl Default for SysinfoHost {
    fn default() -> Self {
        Self::new()
    }
}

impl HostProbe for SysinfoHost {
    fn memory(&self) -> HostMemory {
        let mut guard = self.sys.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(sys) = guard.as_mut() else {
            return HostMemory {
                total: 0,
                available: 0,
            };
        };
        sys.refresh_memory();
        let mut m = HostMemory {
            total: sys.total_memory(),
            available: sys.available_memory(),
        };
        if let Some(cg) = sys.cgroup_limits() {
            m.total = m.total.min(cg.total_memory);
            m.available = m.available.min(cg.free_memory);
        }
        m
    }

    fn cpu_usage(&self) -> Option<f64> {
        let mut guard = self.sys.lock().unwrap_or_else(PoisonError::into_inner);
        let sys = guard.as_mut()?;
        sys.refresh_cpu_usage();
        std::thread::sleep(sysinfo::MINIMUM_CPU_UPDATE_INTERVAL);
        sys.refresh_cpu_usage();
        Some(f64::from(sys.global_cpu_usage()) / 100.0)
    }
}

/// Fixed host facts, to plan admission for a known machine and to test it.
#[derive(Debug, Clone, Copy)]
pub struct FixedHost {
    /// Memory.
    pub memory: HostMemory,
    /// CPU utilization.
    pub cpu: Option<f64>,
}

impl HostProbe for FixedHost {
    fn memory(&self) -> HostMemory {
        self.memory
    }
    fn cpu_usage(&self) -> Option<f64> {
        self.cpu
    }
}

/// Resident memory of a process, bytes (0 if it is gone).
pub(crate) fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
