//! A site's GPUs for a scheduler written in Python (FLARE's resource manager,
//! `rankexec.flare.resources`): the inventory rankexec places ranks on, and whole-job
//! reservations in the host's ledger (`rankexec_executor::admission::site`).
//!
//! Every ledger call takes the ledger's lock (waiting at most 2 s), so it runs without
//! the GIL. A `_GpuReservation` releases its entry when `release()` is called or when
//! it is freed; if this process dies first, the next transaction on the ledger drops
//! the entry (its pid is gone).

use std::sync::{Mutex, PoisonError};

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rankexec_executor::admission::ledger::{Ledger, Reservation};
use rankexec_executor::admission::site::{SiteDecision, SiteRequest, reserve_gpus};
use rankexec_executor::gpu::{NvmlProbe, parse_fixed};
use rankexec_protocol::error_chain;

use crate::rank::errors::RankexecError;

create_exception!(
    rankexec,
    LedgerError,
    RankexecError,
    "The host's reservation ledger cannot be read or written (not private, locked too long, corrupt)."
);

fn json_error(e: serde_json::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The host's GPUs as JSON (`RANKEXEC_GPU_INVENTORY` if declared, else NVML), kept to
/// those named in `visible` (a `CUDA_VISIBLE_DEVICES` value) when given.
#[pyfunction]
#[pyo3(signature = (visible=None))]
fn _gpu_inventory(py: Python<'_>, visible: Option<String>) -> PyResult<String> {
    let inv = py.detach(|| NvmlProbe.all().restrict_to_visible(visible.as_deref()));
    serde_json::to_string(&inv).map_err(json_error)
}

/// A declared inventory (`2x16GiB`, ...) as JSON; `ValueError` when it does not parse.
#[pyfunction]
fn _parse_gpu_inventory(spec: &str) -> PyResult<String> {
    let inv = parse_fixed(spec).map_err(|e| PyValueError::new_err(e.to_string()))?;
    serde_json::to_string(&inv).map_err(json_error)
}

/// The live entries of the user's ledger, as JSON.
#[pyfunction]
fn _gpu_ledger(py: Python<'_>) -> PyResult<String> {
    let ledger = Ledger::default_for_user();
    let entries = py
        .detach(|| ledger.entries())
        .map_err(|e| LedgerError::new_err(error_chain(&e)))?;
    serde_json::to_string(&entries).map_err(json_error)
}

/// GPUs reserved for a job in the host's ledger.
#[pyclass(module = "rankexec._rankexec", name = "_GpuReservation")]
pub struct GpuReservation {
    id: String,
    gpus: Vec<String>,
    held: Mutex<Option<Reservation>>,
}

#[pymethods]
impl GpuReservation {
    /// The ledger entry's id.
    #[getter]
    fn id(&self) -> String {
        self.id.clone()
    }

    /// The GPUs (`CUDA_VISIBLE_DEVICES` names: UUIDs, or indices of a declared
    /// inventory).
    #[getter]
    fn gpus(&self) -> Vec<String> {
        self.gpus.clone()
    }

    /// Whether the entry is still held.
    #[getter]
    fn held(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Removes the entry from the ledger; false if it was already released.
    fn release(&self, py: Python<'_>) -> bool {
        let taken = self
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match taken {
            Some(r) => {
                py.detach(move || drop(r));
                true
            }
            None => false,
        }
    }
}

/// Reserves `num_gpus` GPUs with `mem_per_gpu` bytes each for a job, as ledger entry
/// `id`, by rankexec's placement rules (`ratio`, `floor` in bytes) on the host's GPUs
/// kept to `visible`. Returns `(reservation, "", False)` or `(None, reason, never)`.
#[pyfunction]
#[pyo3(signature = (num_gpus, mem_per_gpu, ratio, floor, visible, id))]
fn _reserve_gpus(
    py: Python<'_>,
    num_gpus: u32,
    mem_per_gpu: u64,
    ratio: f64,
    floor: u64,
    visible: Option<String>,
    id: String,
) -> PyResult<(Option<GpuReservation>, String, bool)> {
    if num_gpus == 0 {
        return Err(PyValueError::new_err("num_gpus must be at least 1"));
    }
    if !(ratio > 0.0 && ratio <= 1.0) {
        return Err(PyValueError::new_err(format!(
            "ratio must be in (0, 1], got {ratio}"
        )));
    }
    let req = SiteRequest {
        num_gpus,
        mem_per_gpu,
        ratio,
        floor,
    };
    let ledger = Ledger::default_for_user();
    let decided = py.detach(|| {
        let inv = NvmlProbe.all().restrict_to_visible(visible.as_deref());
        reserve_gpus(&inv, &ledger, &req, &id)
    });
    match decided {
        Ok(SiteDecision::Granted { uuids, reservation }) => Ok((
            Some(GpuReservation {
                id,
                gpus: uuids,
                held: Mutex::new(Some(reservation)),
            }),
            String::new(),
            false,
        )),
        Ok(SiteDecision::Refused { reason, never }) => Ok((None, reason, never)),
        Err(e) => Err(LedgerError::new_err(format!(
            "reservation ledger {}: {}",
            ledger.path().display(),
            error_chain(&e)
        ))),
    }
}

/// Adds the site GPU functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LedgerError", m.py().get_type::<LedgerError>())?;
    m.add_class::<GpuReservation>()?;
    m.add_function(wrap_pyfunction!(_gpu_inventory, m)?)?;
    m.add_function(wrap_pyfunction!(_parse_gpu_inventory, m)?)?;
    m.add_function(wrap_pyfunction!(_gpu_ledger, m)?)?;
    m.add_function(wrap_pyfunction!(_reserve_gpus, m)?)?;
    Ok(())
}
