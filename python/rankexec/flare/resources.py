"""One GPU authority per FLARE site: FLARE's resource manager backed by rankexec.

Without this, a site's GPUs have two bookkeepers that do not know each other: FLARE's
``GPUResourceManager`` (a job's ``resource_spec`` asks for ``num_of_gpus`` and
``mem_per_gpu_in_GiB``; FLARE's scheduler admits it) and rankexec's NVML placement with
its host-wide reservation ledger. Two jobs admitted by one could collide in the other.

:class:`GpuResourceManager` is FLARE's ``ResourceManagerSpec`` answered by rankexec:

- ``check_resources`` places the job's GPUs as rankexec places ranks (``per_rank``: one
  GPU per requested GPU, best fit; a GPU fits when, after what every executor on the
  host reserved and the job's ``mem_per_gpu_in_GiB``, its used share stays under
  ``gpu_memory_ratio`` and its free memory over ``gpu_memory_floor_GiB``), on the same
  inventory rankexec's executors see, and records the reservation in the host's
  ledger (the file every rankexec executor on the host reads, under ``flock``). A job
  that does not fit gets ``(False, reason)``; FLARE puts the reason in the job's
  ``schedule_history`` (the admin API's job meta) and retries later.
- ``allocate_resources`` hands the reserved GPUs to :class:`GpuResourceConsumer`, which
  sets ``CUDA_VISIBLE_DEVICES`` (and ``RANKEXEC_GPU_GRANT``, the ledger entry) for the
  job process FLARE starts next. rankexec's executor in the job then sees exactly those
  GPUs (it honours ``CUDA_VISIBLE_DEVICES``) and places its ranks on them; its own
  admission does not count the job's grant against the job.
- ``free_resources`` (FLARE calls it when the job process ends, however it ends: done,
  aborted, killed) and ``cancel_resources`` remove the entry. A reservation whose job
  was never started is dropped after ``expiration_period`` seconds. If the client
  process itself dies, the ledger drops its entries at its next transaction (the
  entry's pid is gone): the ledger's reclaim.

A site without NVML (or a test machine without a GPU) declares its GPUs:
``inventory="2x16GiB"`` sets ``RANKEXEC_GPU_INVENTORY`` in the client's environment,
which its job processes inherit, so the manager and the ranks' executors see the same
GPUs (indices ``0``, ``1``, ... are then the ``CUDA_VISIBLE_DEVICES`` names).

``python -m rankexec.flare gpus WORKSPACE [--inventory 2x16GiB]`` installs both
components in the site's resources file (:func:`install`).

Caveats:

- FLARE hands resources to a job through the client process's own environment (its
  consumer sets ``os.environ`` before the job process is spawned, as FLARE's
  ``GPUResourceConsumer`` does): two jobs started at the same instant on one site could
  race. FLARE's scheduler starts one job at a time.
- A job that asks for no GPU is started with ``CUDA_VISIBLE_DEVICES=""`` (no GPU), so it
  cannot use GPUs the authority gave other jobs; ``GpuResourceConsumer(unrequested=
  "site")`` gives such jobs the client's own ``CUDA_VISIBLE_DEVICES`` instead.
- ``mem_per_gpu_in_GiB`` 0 claims no memory: such jobs share GPUs (as with FLARE's
  manager). A declared inventory knows nothing of other programs on the GPUs.
- A job that can never fit (more GPUs than the site has, more memory than any GPU
  keeps) is refused with a reason that says so, but FLARE's scheduler retries it until
  its ``max_schedule_count``; only the server can stop trying.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.resource_manager_spec import ResourceConsumerSpec, ResourceManagerSpec

from rankexec import _rankexec
from rankexec.flare import site

__all__ = [
    "CONSUMER_PATH",
    "GRANT_ENV",
    "INVENTORY_ENV",
    "MANAGER_PATH",
    "GpuResourceConsumer",
    "GpuResourceManager",
    "ReservationUnknown",
    "install",
]

INVENTORY_ENV = "RANKEXEC_GPU_INVENTORY"
"""Declares a site's GPUs (``2x16GiB``) to every rankexec process that inherits it."""
GRANT_ENV = "RANKEXEC_GPU_GRANT"
"""Names, in a job process's environment, the ledger entry its GPUs come from."""
VISIBLE = "CUDA_VISIBLE_DEVICES"
MANAGER_PATH = "rankexec.flare.resources.GpuResourceManager"
CONSUMER_PATH = "rankexec.flare.resources.GpuResourceConsumer"
GIB = 1 << 30
PREFIX = "rankexec GPU authority"


class ReservationUnknown(RuntimeError):
    """``allocate_resources`` got a token with no live reservation (it expired, was
    cancelled, or was never made here)."""


@dataclass
class _Held:
    reservation: Any  # _rankexec._GpuReservation
    job_id: str
    mem_per_gpu: float
    deadline: float | None  # None once allocated


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"resource_spec {key} must be a whole number >= 0, got {value!r}")
    return value


def _gib(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"resource_spec {key} must be a number of GiB >= 0, got {value!r}")
    return float(value)


class GpuResourceManager(ResourceManagerSpec, FLComponent):
    """FLARE's resource manager for a site's GPUs, decided by rankexec's placement and
    recorded in rankexec's host-wide ledger (see the module's doc)."""

    def __init__(
        self,
        inventory: str | None = None,
        num_gpu_key: str = "num_of_gpus",
        gpu_mem_key: str = "mem_per_gpu_in_GiB",
        gpu_memory_ratio: float = 0.8,
        gpu_memory_floor_GiB: float = 2.0,
        expiration_period: float = 30.0,
    ) -> None:
        """
        Args:
            inventory: the site's GPUs when NVML is not to be asked (``"2x16GiB"``,
                ``"80GiB,2x24GiB"``, ``"none"``); set for this process and the jobs it
                starts as ``RANKEXEC_GPU_INVENTORY``. ``None``: NVML (or the variable,
                if the site set it in the client's environment).
            num_gpu_key, gpu_mem_key: the keys of a job's ``resource_spec``.
            gpu_memory_ratio: a GPU's used share after a reservation may not exceed it.
            gpu_memory_floor_GiB: a GPU's free memory after a reservation may not fall
                below it.
            expiration_period: seconds a reservation made by ``check_resources`` waits
                for the job to start (or be cancelled) before it is dropped.
        """
        super().__init__()
        if not 0.0 < float(gpu_memory_ratio) <= 1.0:
            raise ValueError(f"gpu_memory_ratio must be in (0, 1], got {gpu_memory_ratio!r}")
        if not float(gpu_memory_floor_GiB) >= 0.0:
            raise ValueError(f"gpu_memory_floor_GiB must be >= 0, got {gpu_memory_floor_GiB!r}")
        if not float(expiration_period) > 0.0:
            raise ValueError(f"expiration_period must be > 0, got {expiration_period!r}")
        if inventory is not None:
            _rankexec._parse_gpu_inventory(inventory)  # ValueError naming the format
            current = os.environ.get(INVENTORY_ENV)
            if current is not None and current != inventory:
                raise ValueError(
                    f"the site declares its GPUs twice: inventory={inventory!r} and "
                    f"{INVENTORY_ENV}={current!r} in the client's environment"
                )
            os.environ[INVENTORY_ENV] = inventory
        self.num_gpu_key = num_gpu_key
        self.gpu_mem_key = gpu_mem_key
        self.ratio = float(gpu_memory_ratio)
        self.floor = int(float(gpu_memory_floor_GiB) * GIB)
        self.expiration_period = float(expiration_period)
        # The site's own view, before any consumer changes this process's environment.
        self.visible = os.environ.get(VISIBLE)
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    # -- FLARE's ResourceManagerSpec ---------------------------------------------------

    def check_resources(self, resource_requirement: dict, fl_ctx: FLContext) -> tuple[bool, str]:
        """FLARE's scheduler asks whether the job fits: reserves its GPUs in the host's
        ledger and returns ``(True, token)``, or ``(False, why)`` (the reason FLARE records
        in the job's ``schedule_history``)."""
        job_id = str(fl_ctx.get_prop(FLContextKey.CURRENT_JOB_ID, "") or "")
        try:
            num, mem = self._request(resource_requirement)
        except (TypeError, ValueError) as e:
            return False, f"{PREFIX}: {e}"
        token = uuid.uuid4().hex
        if num == 0:
            return True, token
        name = fl_ctx.get_identity_name(default="site")
        try:
            held, reason, never = _rankexec._reserve_gpus(
                num,
                int(mem * GIB),
                self.ratio,
                self.floor,
                self.visible,
                f"flare/{name}/{job_id or '-'}/{token[:8]}",
            )
        except _rankexec.LedgerError as e:
            self.logger.error(f"job {job_id}: cannot reserve GPUs: {e}")
            return False, f"{PREFIX}: {e}"
        if held is None:
            why = f"{PREFIX}: {reason}" + (" (it can never run on this site)" if never else "")
            self.logger.info(f"job {job_id}: {num} GPU(s) x {mem} GiB refused: {why}")
            return False, why
        with self._lock:
            self._held[token] = _Held(held, job_id, mem, time.monotonic() + self.expiration_period)
            self._start_sweeper()
        self.logger.info(f"job {job_id}: reserved GPU(s) {','.join(held.gpus)} as {held.id}")
        return True, token

    def cancel_resources(self, resource_requirement: dict, token: str, fl_ctx: FLContext) -> None:
        """Releases a reservation the job will not use."""
        self._release(token, "cancelled")

    def allocate_resources(self, resource_requirement: dict, token: str, fl_ctx: FLContext) -> dict:
        """Hands the reservation to the starting job: ``{"gpus", "grant", ...}`` for
        ``GpuResourceConsumer``. Raises ``ReservationUnknown`` for a token with no live
        reservation."""
        with self._lock:
            held = self._held.get(token)
            if held is not None:
                held.deadline = None
        if held is None:
            try:
                num, _ = self._request(resource_requirement)
            except (TypeError, ValueError):
                num = -1
            if num != 0:
                raise ReservationUnknown(
                    f"{PREFIX}: no live reservation for token {token!r} (it expired after "
                    f"{self.expiration_period:g} s, was cancelled, or was not made here)"
                )
            return {"gpus": [], "grant": None}
        r = held.reservation
        return {"gpus": list(r.gpus), "grant": r.id, "mem_per_gpu_in_GiB": held.mem_per_gpu}

    def free_resources(self, resources: dict, token: str, fl_ctx: FLContext) -> None:
        """Releases the job's GPUs once its process ended, however it ended."""
        self._release(token, "freed")

    def report_resources(self, fl_ctx: FLContext) -> dict:
        """The site's GPUs, the reservations held here and the host's ledger."""
        report: dict[str, Any] = {
            "inventory": json.loads(_rankexec._gpu_inventory(self.visible)),
            "held_here": self.held(),
        }
        try:
            report["ledger"] = json.loads(_rankexec._gpu_ledger())
        except _rankexec.LedgerError as e:
            report["ledger_error"] = str(e)
        return report

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        """Releases everything held here when the client shuts down (``SYSTEM_END``)."""
        if event_type == EventType.SYSTEM_END:
            self.close()

    # -- ours --------------------------------------------------------------------------

    def held(self) -> dict[str, dict[str, Any]]:
        """The reservations this manager holds now, by token."""
        with self._lock:
            return {
                t: {
                    "id": h.reservation.id,
                    "gpus": list(h.reservation.gpus),
                    "job_id": h.job_id,
                    "allocated": h.deadline is None,
                }
                for t, h in self._held.items()
            }

    def close(self) -> None:
        """Releases every reservation and stops the expiry thread."""
        self._stop.set()
        with self._lock:
            held, self._held = list(self._held.values()), {}
            sweeper = self._sweeper
        for h in held:
            h.reservation.release()
        if sweeper is not None:
            sweeper.join(timeout=5.0)

    def _request(self, requirement: Any) -> tuple[int, float]:
        if not requirement:
            return 0, 0.0
        if not isinstance(requirement, dict):
            raise TypeError(f"resource_spec must be a dict, got {type(requirement).__name__}")
        num = _count(requirement.get(self.num_gpu_key, 0), self.num_gpu_key)
        mem = _gib(requirement.get(self.gpu_mem_key, 0), self.gpu_mem_key)
        if num == 0 and mem > 0:
            raise ValueError(f"{self.gpu_mem_key} {mem:g} is given without {self.num_gpu_key}")
        return num, mem

    def _release(self, token: str, why: str) -> None:
        # Popped and released under the lock that allocate_resources takes: a
        # reservation is either live (and allocatable) or gone from the ledger.
        with self._lock:
            held = self._held.pop(token, None)
            if held is not None:
                held.reservation.release()
        if held is not None:
            self.logger.info(f"job {held.job_id}: {why} {held.reservation.id}")

    def _start_sweeper(self) -> None:
        # Called with the lock held.
        if self._sweeper is None and not self._stop.is_set():
            self._sweeper = threading.Thread(
                target=self._sweep, name="rankexec-gpu-expiry", daemon=True
            )
            self._sweeper.start()

    def _sweep(self) -> None:
        period = min(1.0, self.expiration_period / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            # Picked, removed and released under one hold of the lock: an allocation
            # either comes first (the reservation is no longer expiring) or finds the
            # token gone (ReservationUnknown); it never gets GPUs whose entry is removed.
            with self._lock:
                expired = [
                    (t, h)
                    for t, h in self._held.items()
                    if h.deadline is not None and h.deadline <= now
                ]
                for t, h in expired:
                    del self._held[t]
                    h.reservation.release()
                idle = all(h.deadline is None for h in self._held.values())
                if idle:
                    self._sweeper = None
            for _, h in expired:
                why = f"expired (no start within {self.expiration_period:g} s)"
                self.logger.info(f"job {h.job_id}: {why} {h.reservation.id}")
            if idle:
                return


class GpuResourceConsumer(ResourceConsumerSpec):
    """Gives the next job process the GPUs :class:`GpuResourceManager` reserved for it:
    ``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``RANKEXEC_GPU_GRANT``
    in the client's environment, which FLARE's process launcher copies into the job's."""

    def __init__(self, unrequested: str = "none") -> None:
        """
        Args:
            unrequested: what a job that asked for no GPU sees: ``"none"`` (no GPU,
                ``CUDA_VISIBLE_DEVICES=""``) or ``"site"`` (the client's own
                ``CUDA_VISIBLE_DEVICES``, unset if it had none).
        """
        if unrequested not in ("none", "site"):
            raise ValueError(f"unrequested must be 'none' or 'site', got {unrequested!r}")
        self.unrequested = unrequested
        self.site_visible = os.environ.get(VISIBLE)

    def consume(self, resources: dict) -> None:
        """Sets the next job process's GPUs from what ``allocate_resources`` returned."""
        gpus = resources.get("gpus") or []
        grant = resources.get("grant")
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if gpus:
            os.environ[VISIBLE] = ",".join(str(g) for g in gpus)
            if grant:
                os.environ[GRANT_ENV] = str(grant)
            else:
                os.environ.pop(GRANT_ENV, None)
            return
        os.environ.pop(GRANT_ENV, None)
        if self.unrequested == "none":
            os.environ[VISIBLE] = ""
        elif self.site_visible is None:
            os.environ.pop(VISIBLE, None)
        else:
            os.environ[VISIBLE] = self.site_visible


def _components(
    path: str,
    inventory: str | None,
    ratio: float | None,
    floor_gib: float | None,
    unrequested: str | None,
) -> Callable[[dict[str, Any]], None]:
    manager_args: dict[str, Any] = {}
    if inventory is not None:
        manager_args["inventory"] = inventory
    if ratio is not None:
        manager_args["gpu_memory_ratio"] = ratio
    if floor_gib is not None:
        manager_args["gpu_memory_floor_GiB"] = floor_gib
    consumer_args: dict[str, Any] = {}
    if unrequested is not None:
        consumer_args["unrequested"] = unrequested
    wanted = {
        "resource_manager": {"id": "resource_manager", "path": MANAGER_PATH, "args": manager_args},
        "resource_consumer": {
            "id": "resource_consumer",
            "path": CONSUMER_PATH,
            "args": consumer_args,
        },
    }

    def change(doc: dict[str, Any]) -> None:
        components = doc.get("components")
        if components is None:
            components = doc["components"] = []
        if not isinstance(components, list):
            raise site.SiteFileError(f"{path}: 'components' is not a list, left as it is", path)
        seen = set()
        for i, c in enumerate(components):
            cid = c.get("id") if isinstance(c, dict) else None
            if cid in wanted:
                components[i] = dict(wanted[cid])
                seen.add(cid)
        components.extend(dict(v) for k, v in wanted.items() if k not in seen)

    return change


def install(
    workspace: str,
    inventory: str | None = None,
    *,
    ratio: float | None = None,
    floor_gib: float | None = None,
    unrequested: str | None = None,
    dry_run: bool = False,
) -> site.ResourcesEdit:
    """Makes rankexec the GPU authority of the FLARE site at ``workspace``: sets the
    ``resource_manager`` and ``resource_consumer`` components of its resources file to
    :class:`GpuResourceManager` (with ``inventory``, ``gpu_memory_ratio``,
    ``gpu_memory_floor_GiB`` when given) and :class:`GpuResourceConsumer`, keeping every
    other key (``rankexec.flare.site.edit_resources``: atomic, with a backup). A bad
    ``inventory`` is a ``ValueError`` and nothing is written."""
    if inventory is not None:
        _rankexec._parse_gpu_inventory(inventory)
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise ValueError(f"gpu_memory_ratio must be in (0, 1], got {ratio}")
    if floor_gib is not None and not floor_gib >= 0.0:
        raise ValueError(f"gpu_memory_floor_GiB must be >= 0, got {floor_gib}")
    if unrequested is not None and unrequested not in ("none", "site"):
        raise ValueError(f"unrequested must be 'none' or 'site', got {unrequested!r}")
    change = _components(
        site.resources_paths(workspace)[0], inventory, ratio, floor_gib, unrequested
    )
    return site.edit_resources(workspace, change, dry_run=dry_run)


def add_cli(sub: Any) -> None:
    """Adds ``gpus`` to ``python -m rankexec.flare``'s subcommands."""
    g = sub.add_parser(
        "gpus",
        help="make rankexec the site's GPU authority (resource_manager, resource_consumer)",
    )
    g.add_argument("workspace", help="the site's workspace (its startup kit, or a folder)")
    g.add_argument(
        "--inventory",
        help="declare the site's GPUs instead of asking NVML, e.g. 2x16GiB or 80GiB,2x24GiB",
    )
    g.add_argument("--ratio", type=float, help="gpu_memory_ratio (default 0.8)")
    g.add_argument("--floor-gib", type=float, help="gpu_memory_floor_GiB (default 2)")
    g.add_argument(
        "--unrequested",
        choices=["none", "site"],
        help="GPUs of a job that asks for none: none (default) or the client's own",
    )
    g.add_argument("--dry-run", action="store_true", help="print the change, write nothing")


def cli(args: Any) -> int:
    """Runs ``python -m rankexec.flare gpus``: prints the change, or the error."""
    try:
        edit = install(
            args.workspace,
            args.inventory,
            ratio=args.ratio,
            floor_gib=args.floor_gib,
            unrequested=args.unrequested,
            dry_run=args.dry_run,
        )
    except (ValueError, site.SiteFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(edit.describe())
    return 0
