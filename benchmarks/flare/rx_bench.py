"""The client side of the side-by-side benchmark for rankexec: the peer harness's
measurement plan (same phases, same JSON records, `"impl": "rankexec"`) run through
`rankexec.flare.MultiProcessExecutor`.

Copied into the generated job's `app/custom/`. Every task goes through the adapter's
own `execute()` (DXO in, DXO out, FLARE's abort signal polled), exactly as a FLARE
client calls it: the payload is a DXO array of random bytes, copied once into shared
memory (pages prepared while the group was idle) and mapped by every rank.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import zlib

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from rankexec.flare import MultiProcessExecutor

BENCH_TASK = "nvfbench"
WORK_TASK = "echo_task"
_lock = threading.Lock()


def emit(rec: dict) -> None:
    rec = dict(rec)
    rec.setdefault("impl", "rankexec")
    rec.setdefault("run", os.environ.get("NVFBENCH_RUN", ""))
    rec.setdefault("pid", os.getpid())
    line = json.dumps(rec, sort_keys=True)
    path = os.environ.get("NVFBENCH_OUT")
    with _lock:
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: dict, t0: float, cap_s: float) -> dict:
    gone: dict = {}
    while True:
        now = time.perf_counter()
        for k, p in pids.items():
            if k not in gone and not _alive(p):
                gone[k] = now - t0
        if len(gone) == len(pids) or now - t0 > cap_s:
            break
        time.sleep(0.002)
    return {str(k): gone.get(k) for k in pids}


class RxBenchExecutor(MultiProcessExecutor):
    def __init__(self, num_of_processes: int = 1, plan: dict | None = None, **kw) -> None:
        super().__init__(num_of_processes=num_of_processes, **kw)
        self.plan = plan or {}
        self.cap_s = float(self.plan.get("cap_s", 60.0))
        self._errors: list[str] = []

    def log_error(self, fl_ctx, msg, fire_event=True):
        self._errors.append(msg.splitlines()[0])
        return super().log_error(fl_ctx, msg, fire_event=fire_event)

    def _rank_pids(self) -> dict:
        return {} if self._group is None else dict(enumerate(self._group.pids()))

    # ---- START_RUN / END_RUN -------------------------------------------------------

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            t0 = time.perf_counter()
            super().handle_event(event_type, fl_ctx)
            t1 = time.perf_counter()
            emit(
                {
                    "metric": "startup",
                    "n": self._n,
                    "ready": self._group is not None and len(self._rank_pids()) == self._n,
                    "start_run_to_ready_s": t1 - t0,
                    "ranks_spawned_s": None,
                    "all_ranks_reachable_s": None,
                    "errors": self._errors[:3],
                }
            )
        elif event_type == EventType.END_RUN and self._group is not None:
            pids = {f"rank{r}": p for r, p in self._rank_pids().items()}
            t0 = time.perf_counter()
            super().handle_event(event_type, fl_ctx)
            t1 = time.perf_counter()
            gone = _wait_gone(pids, t0, self.cap_s)
            vals = list(gone.values())
            emit(
                {
                    "metric": "abort",
                    "case": "END_RUN->finalize (ranks idle)",
                    "n": self._n,
                    "finalize_call_s": t1 - t0,
                    "all_gone_s": None if None in vals else max(vals),
                    "per_process_gone_s": gone,
                }
            )
        else:
            super().handle_event(event_type, fl_ctx)

    # ---- one task through the adapter ----------------------------------------------

    @staticmethod
    def _task(size: int = 0, mode: str = "echo", **steer) -> tuple[Shareable, np.ndarray]:
        payload = np.frombuffer(os.urandom(size), dtype=np.uint8) if size else np.zeros(0, np.uint8)
        dxo = DXO(
            data_kind=DataKind.WEIGHTS,
            data={"payload": payload},
            meta={"mode": mode, **steer},
        )
        return dxo.to_shareable(), payload

    def _timed(self, s: Shareable, fl_ctx: FLContext, abort: Signal | None = None, after=None):
        abort = abort or Signal()
        timer = None
        if after is not None:
            timer = threading.Timer(after, abort.trigger, args=(True,))
        t0 = time.perf_counter()
        if timer:
            timer.start()
        res = MultiProcessExecutor.execute(self, WORK_TASK, s, fl_ctx, abort)
        dt = time.perf_counter() - t0
        rc = res.get_return_code()
        return {
            "elapsed_s": dt,
            "result": res,
            "rc": rc,
            "status": "ok" if rc == ReturnCode.OK else "error_reply",
        }

    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        if task_name != BENCH_TASK:
            return super().execute(task_name, shareable, fl_ctx, abort_signal)
        for phase in self.plan.get("phases", []):
            kind = phase.get("kind")
            try:
                getattr(self, "_phase_" + kind)(phase, fl_ctx)
            except Exception as e:  # noqa: BLE001 (a harness reports, it does not stop)
                emit(
                    {
                        "metric": "phase_error",
                        "phase": kind,
                        "error": repr(e),
                        "n": self._n,
                    }
                )
        return make_reply(ReturnCode.OK)

    # ---- phases (the peer harness's plan) ------------------------------------------

    def _phase_roundtrip(self, ph, fl_ctx):
        for size in ph.get("sizes", [1024]):
            for mode in ph.get("modes", ["echo"]):
                rounds, warmup = int(ph.get("rounds", 5)), int(ph.get("warmup", 1))
                elapsed, statuses, correct = [], [], True
                for i in range(warmup + rounds):
                    s, payload = self._task(size, mode)
                    r = self._timed(s, fl_ctx)
                    statuses.append(r["status"])
                    if r["status"] != "ok":
                        break
                    out = from_shareable(r["result"])
                    if mode == "echo":
                        back = out.data.get("payload")
                        correct = correct and back is not None and np.array_equal(back, payload)
                    else:
                        correct = correct and out.data.get("adler32") == zlib.adler32(payload)
                    if i >= warmup:
                        elapsed.append(r["elapsed_s"])
                    del s, payload, out, r
                ok = len(elapsed) == rounds
                med = statistics.median(elapsed) if elapsed else None
                emit(
                    {
                        "metric": "roundtrip",
                        "n": self._n,
                        "size_bytes": size,
                        "mode": mode,
                        "rounds": len(elapsed),
                        "ok": ok and correct,
                        "statuses": sorted(set(statuses)),
                        "median_s": med,
                        "min_s": min(elapsed) if elapsed else None,
                        "max_s": max(elapsed) if elapsed else None,
                        "median_result_arrival_s": med,
                        "payload_MBps": (size / med / 1e6) if med else None,
                        "payload_MBps_at_arrival": (size / med / 1e6) if med else None,
                    }
                )

    def _phase_kill_rank_idle(self, ph, fl_ctx):
        rank = int(ph.get("rank", 1))
        pids = self._rank_pids()
        victim = pids.get(rank)
        if victim is None:
            emit(
                {
                    "metric": "fault",
                    "case": f"a_kill_rank{rank}_idle",
                    "outcome": "rank not found",
                }
            )
            return
        os.kill(victim, 9)
        gone = _wait_gone({rank: victim}, time.perf_counter(), 5.0)
        n_err = len(self._errors)
        r = self._timed(self._task(1024)[0], fl_ctx)
        r2 = self._timed(self._task(1024)[0], fl_ctx)
        emit(
            {
                "metric": "fault",
                "case": f"a_kill_rank{rank}_idle_then_execute",
                "n": self._n,
                "killed_rank": rank,
                "victim_gone_s": gone.get(str(rank)),
                "settle_s": 0.0,
                "execute_status": r["status"],
                "execute_rc": r["rc"],
                "execute_elapsed_s": r["elapsed_s"],
                "next_execute_status": r2["status"],
                "next_execute_s": r2["elapsed_s"],
                "other_ranks_alive": {str(k): _alive(p) for k, p in pids.items()},
                "errors_logged": self._errors[n_err:][:2],
            }
        )

    def _phase_raise_in_rank(self, ph, fl_ctx):
        rank = int(ph.get("rank", 1))
        n_err = len(self._errors)
        r = self._timed(self._task(1024, raise_on_rank=rank)[0], fl_ctx)
        rec = {
            "metric": "fault",
            "case": f"b_rank{rank}_raises_in_execute",
            "n": self._n,
            "execute_status": r["status"],
            "execute_elapsed_s": r["elapsed_s"],
            "result_rc": r["rc"],
            "ranks_alive_after": {str(k): _alive(p) for k, p in self._rank_pids().items()},
            "errors_logged_in_parent": self._errors[n_err:][:2],
        }
        r2 = self._timed(self._task(1024)[0], fl_ctx)
        rec["next_normal_execute_status"] = r2["status"]
        rec["next_normal_execute_s"] = r2["elapsed_s"]
        emit(rec)

    def _phase_abort_inflight(self, ph, fl_ctx):
        sleep_s, after = (
            float(ph.get("sleep_s", 5.0)),
            float(ph.get("abort_after_s", 0.5)),
        )
        pids = {f"rank{r}": p for r, p in self._rank_pids().items()}
        r = self._timed(self._task(1024, sleep_s=sleep_s)[0], fl_ctx, after=after)
        emit(
            {
                "metric": "abort",
                "case": "abort_signal triggered while task in flight",
                "n": self._n,
                "rank_task_duration_s": sleep_s,
                "abort_triggered_at_s": after,
                "execute_status": r["status"],
                "execute_rc": r["rc"],
                "execute_returned_at_s": r["elapsed_s"],
                "execute_returned_after_abort_s": r["elapsed_s"] - after,
                "ranks_alive_after": {k: _alive(p) for k, p in pids.items()},
            }
        )

    def _phase_abort_pretriggered(self, ph, fl_ctx):
        pids = {f"rank{r}": p for r, p in self._rank_pids().items()}
        sig = Signal()
        sig.trigger(True)
        r = self._timed(self._task(1024)[0], fl_ctx, abort=sig)
        emit(
            {
                "metric": "abort",
                "case": "execute() called with abort_signal already triggered",
                "n": self._n,
                "execute_status": r["status"],
                "execute_rc": r["rc"],
                "execute_elapsed_s": r["elapsed_s"],
                "all_gone_s": None,
                "ranks_alive_after": {k: _alive(p) for k, p in pids.items()},
            }
        )

    def _phase_await_parent_kill(self, ph, fl_ctx):
        state = {
            "phase": "await_parent_kill",
            "parent_pid": os.getpid(),
            "launcher_pid": None,
            "rank_pids": {str(k): p for k, p in self._rank_pids().items()},
        }
        path = os.environ["NVFBENCH_STATE"]
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)
        time.sleep(float(ph.get("wait_s", self.cap_s)))
        emit(
            {
                "metric": "phase_error",
                "phase": "await_parent_kill",
                "error": "parent was not killed",
            }
        )
