"""FLARE Client API scripts (``import nvflare.client as flare``) on rank groups of
``rankexec.flare.ScriptExecutor``: the model's way to the ranks and back, rank
semantics, and the failure promises (a raising or dying rank, an abort, the end).

These drive the executor's real rank group (real interpreters running the scripts
through ``python -m rankexec.flare.run_script``) without the simulator; the example job
under the real ``nvflare simulator`` is in test_client_api_sim.py.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReturnCode
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from rankexec.flare import ScriptExecutor
from rankexec.host import Aborted, RankFailed, RankGroup

from .flare_helpers import wait_until

CAP_S = 120.0


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            return False
    return True


class Group:
    """A ScriptExecutor's rank group running `script` (in the app folder's custom/)."""

    def __init__(
        self, tmp_path: Path, script: str, on_event=None, group_cfg=None, **executor_args
    ) -> None:
        app = tmp_path / "app"
        (app / "custom").mkdir(parents=True, exist_ok=True)
        (app / "custom" / "client.py").write_text(textwrap.dedent(script))
        (app / "custom" / "helper_mod.py").write_text("ANSWER = 42\n")
        self.marks = tmp_path / "marks"
        self.marks.mkdir(exist_ok=True)
        args = {"num_of_processes": 2, "script_args": ["--marks", str(self.marks)]}
        args.update(executor_args)
        self.executor = ScriptExecutor(script="custom/client.py", **args)
        self.executor._site, self.executor._job = "site-7", "job-1"
        run = tmp_path / "run"
        cfg = self.executor.group_config(str(run), str(app))
        cfg["deadlines"] = {"task": "120s", "abort_grace": "60s", "shutdown_grace": "60s"}
        cfg.update(group_cfg or {})
        self.group = RankGroup(
            cfg, on_event=on_event, site="site-7", job_id="job-1", workspace=str(run)
        )
        self.group.start()
        self.executor._group = self.group
        self.pids = self.group.pids()
        self.log_dir = Path(self.group.log_dir or "")

    def stdout(self, rank: int) -> str:
        return (self.log_dir / f"rank-{rank}" / "stdout.log").read_text(errors="replace")

    def stderr(self, rank: int) -> str:
        return (self.log_dir / f"rank-{rank}" / "stderr.log").read_text(errors="replace")

    def execute(self, task: str, weights: dict, round_: int = 0, total: int = 3):
        shareable = DXO(DataKind.WEIGHTS, data=weights).to_shareable()
        shareable.set_header(AppConstants.CURRENT_ROUND, round_)
        shareable.set_header(AppConstants.NUM_ROUNDS, total)
        ctx = FLContext()
        ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-7", private=False, sticky=False)
        ctx.set_prop(ReservedKey.RUN_NUM, "job-1", private=False, sticky=False)
        return self.executor.execute(task, shareable, ctx, Signal())

    def close(self) -> dict:
        report = self.group.close()
        assert wait_until(lambda: _gone(self.pids), timeout=30), f"ranks left: {self.pids}"
        return report


@pytest.fixture
def groups():
    made: list[Group] = []

    def make(tmp_path: Path, script: str, **kw) -> Group:
        g = Group(tmp_path, script, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.group.close()


PREAMBLE = """
    import argparse, json, os, sys, time
    import numpy as np
    import nvflare.client as flare
    from nvflare.app_common.abstract.fl_model import FLModel

    p = argparse.ArgumentParser()
    p.add_argument("--marks")
    args = p.parse_args()
    rank = int(os.environ["RANK"])

    def mark(name, text=""):  # atomic: the test may read it while it is written
        with open(os.path.join(args.marks, name + ".tmp"), "w") as f:
            f.write(text)
        os.rename(os.path.join(args.marks, name + ".tmp"), os.path.join(args.marks, name))
"""

ECHO = (
    PREAMBLE
    + """
    from helper_mod import ANSWER   # beside the script, as under `python custom/client.py`
    flare.init()
    mark(f"start-{rank}", json.dumps({
        "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "answer": ANSWER,
        "env": {k: os.environ.get(k) for k in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
        "site": flare.get_site_name(), "job": flare.get_job_id(),
        "sys_info": flare.system_info(),
        "received": flare.receive() is None if rank != 0 else None,
    }))
    n = 0
    while flare.is_running():   # every rank: True once per task, False at the end
        m = flare.receive()
        n += 1
        if rank != 0:           # FLARE's semantics: only rank 0 receives
            mark(f"iteration-{rank}-{n}", json.dumps(m is None))
            continue
        kinds = {k: type(v).__module__ + "." + type(v).__name__ for k, v in m.params.items()}
        cfg = flare.get_config()["TASK_EXCHANGE"]
        out = {k: v * 3 for k, v in m.params.items()}
        meta = {"NUM_STEPS_CURRENT_ROUND": 5, "kinds": kinds, "task": flare.get_task_name(),
                "is_train": flare.is_train(), "is_submit": flare.is_submit_model(),
                "train_with_eval": cfg["train_with_eval"], "in_meta": m.meta,
                "round": m.current_round, "total": m.total_rounds}
        flare.send(FLModel(params=out, metrics={"loss": 0.25}, meta=meta))
    mark(f"end-{rank}")
    # Left open, unflushed: the rank's quick end after the close still writes it out.
    left_open = open(os.path.join(args.marks, f"unclosed-{rank}"), "w")
    left_open.write("buffered, never flushed by the script")
"""
)


def test_script_runs_as_python_script_with_torchrun_env_and_flare_semantics(tmp_path, groups):
    g = groups(tmp_path, ECHO, train_with_evaluation=True)
    reply = g.execute("train", {"w": np.arange(4, dtype=np.float32)}, round_=1, total=3)
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK, reply
    dxo = from_shareable(reply)
    assert dxo.data_kind == DataKind.WEIGHTS
    np.testing.assert_array_equal(dxo.data["w"], np.arange(4, dtype=np.float32) * 3)
    meta = dxo.meta
    print("rank 0 saw:", json.dumps({k: meta[k] for k in ("kinds", "task", "round", "total")}))
    assert meta["NUM_STEPS_CURRENT_ROUND"] == 5
    assert meta["initial_metrics"] == {"loss": 0.25}
    assert meta["kinds"] == {"w": "numpy.ndarray"}  # server_expected NUMPY, exchange RAW
    assert (meta["task"], meta["is_train"], meta["is_submit"]) == ("train", True, False)
    assert meta["train_with_eval"] is True
    assert (meta["round"], meta["total"]) == (1, 3)
    assert meta["in_meta"]["site_name"] == "site-7" and meta["in_meta"]["job_id"] == "job-1"
    assert reply.get_header(AppConstants.CURRENT_ROUND) == 1
    for r in (0, 1):
        # Rank 1's script writes its mark at its own pace (rank 0 does not wait for it).
        assert wait_until(lambda r=r: (g.marks / f"start-{r}").exists(), timeout=CAP_S)
        start = json.loads((g.marks / f"start-{r}").read_text())
        assert start["name"] == "__main__"
        assert start["argv"] == ["custom/client.py", "--marks", str(g.marks)]
        assert start["cwd"] == str(tmp_path / "app") and start["answer"] == 42
        env = start["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(r), "2", str(r))
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert (start["site"], start["job"]) == ("site-7", "job-1")
        assert start["sys_info"] == {"site_name": "site-7", "job_id": "job-1"}
    rank1 = json.loads((g.marks / "start-1").read_text())
    assert rank1["received"] is True  # FLARE's rank != 0: receive() gives None
    # A second task on the same group; then the close ends every rank's loop.
    reply = g.execute("train", {"w": np.ones(2, dtype=np.float32)}, round_=2)
    np.testing.assert_array_equal(from_shareable(reply).data["w"], np.full(2, 3, np.float32))
    report = g.close()
    print("close:", report)
    assert report["escalated"] is None  # every rank ended on its own: no SIGTERM
    for r in (0, 1):
        assert (g.marks / f"end-{r}").exists()
        assert "Traceback" not in g.stderr(r)
        # The file the script left open was flushed when the rank ended (no teardown).
        unclosed = (g.marks / f"unclosed-{r}").read_text()
        assert unclosed == "buffered, never flushed by the script", unclosed
    # Rank 1's loop ran once per task, never receiving, and ended with the run.
    iterations = sorted(p.name for p in g.marks.glob("iteration-1-*"))
    assert iterations == ["iteration-1-1", "iteration-1-2"], iterations
    assert all(json.loads((g.marks / i).read_text()) is True for i in iterations)


DIFF_TORCH = (
    PREAMBLE
    + """
    import torch
    flare.init()
    while flare.is_running():
        m = flare.receive()
        if m is None:   # a rank that does not receive (FLARE's semantics)
            continue
        assert all(isinstance(v, torch.Tensor) for v in m.params.values()), m.params
        m.params["w"] += 1   # copy-on-write: the shared model is not changed
        out = {k: v * 2 for k, v in m.params.items()}
        flare.send(FLModel(params=out, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
"""
)


def test_pytorch_exchange_and_diff_transfer_as_in_flare(tmp_path, groups):
    g = groups(
        tmp_path,
        DIFF_TORCH,
        params_exchange_format="pytorch",
        params_transfer_type="DIFF",
    )
    w = np.arange(4, dtype=np.float32)
    reply = g.execute("train", {"w": w, "b": np.ones((2, 2), np.float64)})
    dxo = from_shareable(reply)
    assert dxo.data_kind == DataKind.WEIGHT_DIFF
    # The script received tensors, changed w in place to w+1 and sent 2*(w+1); the
    # DIFF is taken against what it received (its own copy-on-write view).
    np.testing.assert_array_equal(dxo.data["w"], 2 * (w + 1) - (w + 1))
    np.testing.assert_array_equal(dxo.data["b"], np.ones((2, 2)))
    assert dxo.data["b"].dtype == np.float64
    np.testing.assert_array_equal(w, np.arange(4, dtype=np.float32))  # the input is intact
    print("DIFF reply:", {k: v.tolist() for k, v in dxo.data.items()})


RAISES = (
    PREAMBLE
    + """
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    flare.init(rank=str(rank))
    while True:
        order = torch.zeros(2, dtype=torch.int64)
        if rank == 0 and flare.is_running():
            m = flare.receive()
            order[:] = torch.tensor([1, m.current_round])
        dist.broadcast(order, 0)
        if order[0].item() == 0:
            break
        if order[1].item() == 1:   # round 1: rank 1 raises during the DDP step
            if rank == 1:
                mark("raised", repr(time.time()))
                raise RuntimeError("bad batch on rank 1")
            dist.all_reduce(torch.ones(4))   # rank 0 waits in the collective
        if rank == 0:
            flare.send(FLModel(params=m.params))
    dist.destroy_process_group()
"""
)


def test_a_rank_that_raises_fails_the_task_at_once_naming_rank_and_exception(tmp_path, groups):
    g = groups(tmp_path, RAISES)
    ok = g.execute("train", {"w": np.ones(3, np.float32)}, round_=0)
    assert ok.get_return_code(ReturnCode.OK) == ReturnCode.OK
    with pytest.raises(RankFailed) as info:
        g.group.execute("train", {"flare_model": {"current_round": 1}}, {})
    seen = time.time()
    raised = float((g.marks / "raised").read_text())
    e = info.value
    print(f"rank {e.rank} failed {1e3 * (seen - raised):.1f} ms after its raise: {e}")
    assert e.rank == 1
    assert "RuntimeError: bad batch on rank 1" in str(e)
    g.close()


def test_a_raising_rank_fails_the_flare_task_with_execution_exception(tmp_path, groups):
    g = groups(tmp_path, RAISES)
    g.execute("train", {"w": np.ones(3, np.float32)}, round_=0)
    reply = g.execute("train", {"w": np.ones(3, np.float32)}, round_=1)
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    error = reply.get_header("rankexec_error")
    print("reply header:", error)
    assert "rank 1" in error and "RuntimeError: bad batch on rank 1" in error
    g.close()


DIES = (
    PREAMBLE
    + """
    import signal
    flare.init(rank=str(rank))
    while flare.is_running():     # every rank receives (all_ranks_receive)
        m = flare.receive()
        if rank == 1 and m.current_round == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and m.current_round == 2:
            raise ValueError("rank 1 cannot take round 2")
        flare.send(FLModel(params=m.params, metrics={"round": m.current_round}))
"""
)


def test_with_all_ranks_receive_a_rank_dying_or_raising_in_its_task_is_named(tmp_path, groups):
    g = groups(tmp_path, DIES, all_ranks_receive=True)
    assert g.execute("train", {"w": np.ones(3, np.float32)}).get_return_code() == ReturnCode.OK
    with pytest.raises(RankFailed) as info:
        g.group.execute("train", {"flare_model": {"current_round": 1}}, {})
    print("killed:", info.value)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    # The next task relaunches the group (restart policy); rank 1 raises in round 2.
    with pytest.raises(RankFailed) as info:
        g.group.execute("train", {"flare_model": {"current_round": 2}}, {})
    print("raised:", info.value)
    assert info.value.rank == 1
    assert "ValueError: rank 1 cannot take round 2" in str(info.value)
    g.pids = list(set(g.pids) | set(g.group.pids()))
    g.close()


ABORTABLE = (
    PREAMBLE
    + """
    flare.init(rank=str(rank))
    while flare.is_running():
        m = flare.receive()
        if m is None:             # a rank that does not receive (FLARE's semantics)
            continue
        if m.current_round == 0:
            mark(f"in-task-{rank}")
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(args.marks, "go")):
                if time.monotonic() > deadline:
                    sys.exit("never told to go on")
                time.sleep(0.005)
        flare.send(FLModel(params={k: v + 1 for k, v in (m.params or {}).items()}))
        mark(f"sent-{rank}-{m.current_round}")
    mark(f"end-{rank}")
"""
)


@pytest.mark.parametrize("all_ranks", [False, True])
def test_an_abort_reaches_every_receiving_rank_and_the_group_survives(tmp_path, groups, all_ranks):
    g = groups(tmp_path, ABORTABLE, all_ranks_receive=all_ranks)
    receiving = [0, 1] if all_ranks else [0]

    def go_once_aborted() -> None:
        # Once every receiving rank's runtime has its abort, its script goes on to send().
        wait_until(lambda: all("abort requested" in g.stderr(r) for r in receiving), timeout=CAP_S)
        (g.marks / "go").touch()

    def abort_when_inside() -> bool:
        if all((g.marks / f"in-task-{r}").exists() for r in receiving):
            threading.Thread(target=go_once_aborted, daemon=True).start()
            return True
        return False

    with pytest.raises(Aborted) as info:
        g.group.execute(
            "train",
            {"flare_model": {"current_round": 0}},
            {},
            abort_check=abort_when_inside,
            abort_reason="the controller aborted",
        )
    print("aborted:", info.value, "forced:", info.value.forced)
    assert info.value.forced is False  # every rank answered: the group lives on
    assert g.group.pids() == g.pids
    for r in receiving:
        # The rank's stderr reaches its log file through the host's relay thread.
        warning = "task `train` was aborted (the controller aborted)"
        assert wait_until(lambda r=r, w=warning: w in g.stderr(r), timeout=CAP_S), g.stderr(r)
    reply = g.execute("train", {"w": np.ones(2, np.float32)}, round_=1)
    np.testing.assert_array_equal(from_shareable(reply).data["w"], np.full(2, 2, np.float32))
    assert g.close()["escalated"] is None
    for r in (0, 1):
        assert (g.marks / f"end-{r}").exists()


LOGS = (
    PREAMBLE
    + """
    from nvflare.client.tracking import SummaryWriter
    flare.init()
    writer = SummaryWriter()
    while flare.is_running():
        m = flare.receive()
        if m is None:   # a rank that does not receive (FLARE's semantics)
            continue
        writer.add_scalar("loss", 0.5, global_step=m.current_round)
        flare.send(FLModel(metrics={"loss": 0.5}))
"""
)


def test_flare_log_from_rank0_reaches_the_host_as_a_rank_event(tmp_path, groups):
    seen: list[tuple[str, int | None, dict]] = []
    g = groups(tmp_path, LOGS, on_event=lambda e, r, p: seen.append((e, r, p)))
    g.group.execute("train", {"flare_model": {"current_round": 4}}, {})
    g.close()
    logged = [(r, json.loads(p["__rankexec_flare_log__"])) for e, r, p in seen if "flare" in e]
    print("logged:", logged)
    assert logged == [
        (
            0,
            {
                "key": "loss",
                "value": 0.5,
                "data_type": "SCALAR",
                "kwargs": {"global_step": 4, "writer": "TORCH_TENSORBOARD"},
            },
        )
    ]


def test_the_executor_refuses_a_script_that_is_not_python(tmp_path):
    with pytest.raises(ValueError, match="script must name a .py file"):
        ScriptExecutor(script="custom/client.sh")
    with pytest.raises(ValueError, match="params_exchange_format must be one of"):
        ScriptExecutor(script="custom/client.py", params_exchange_format="jax")
    assert os.path.basename(__file__)


def test_the_script_starts_before_flare_is_imported_and_its_own_import_installs_the_api(
    tmp_path, groups
):
    """A rank runs the script without importing nvflare first (the script imports it
    anyway: the rank must not pay for it twice); the script's own import installs
    the rank's Client API, here through a submodule imported before the package."""
    g = groups(
        tmp_path,
        """
        import json, os, sys
        first = sorted(m for m in sys.modules if m.split(".")[0] == "nvflare")
        from nvflare.client.tracking import SummaryWriter  # imports nvflare.client first
        import nvflare.client as flare

        flare.init()
        rank = int(os.environ["RANK"])
        marks = sys.argv[sys.argv.index("--marks") + 1]
        with open(os.path.join(marks, f"first-{rank}.tmp"), "w") as f:
            json.dump(first, f)
        os.rename(os.path.join(marks, f"first-{rank}.tmp"), os.path.join(marks, f"first-{rank}"))
        while flare.is_running():
            m = flare.receive()
            if m is None:   # a rank that does not receive (FLARE's semantics)
                continue
            flare.send(flare.FLModel(params={k: v + 1 for k, v in m.params.items()}))
        """,
    )
    reply = g.execute("train", {"w": np.arange(3, dtype=np.float32)})
    assert reply.get_return_code() == "OK", reply
    assert from_shareable(reply).data["w"].tolist() == [1.0, 2.0, 3.0]
    for rank in (0, 1):
        mark = g.marks / f"first-{rank}"
        assert wait_until(lambda mark=mark: mark.exists() and mark.read_text(), timeout=CAP_S)
        assert json.loads(mark.read_text()) == []
    g.close()


def test_the_rank_program_uses_flare_s_own_names_for_its_hook():
    """The rank program names FLARE's environment variables without importing nvflare;
    they must be FLARE's."""
    from nvflare.client.api_spec import CLIENT_API_TYPE_KEY
    from nvflare.client.cell.bootstrap import BOOTSTRAP_FILE_ENV_VAR

    from rankexec.flare import _script_rank

    assert _script_rank.CLIENT_API_TYPE_ENV == CLIENT_API_TYPE_KEY
    assert _script_rank.BOOTSTRAP_FILE_ENV == BOOTSTRAP_FILE_ENV_VAR


FORGETS = (
    PREAMBLE
    + """
    from nvflare.client.api import clear
    flare.init()
    n = 0
    while flare.is_running():
        m = flare.receive()
        n += 1
        if rank == 0 and n == 1:
            clear()                # forgets the task (as Lightning's callback does): no send
            continue
        if rank == 0:
            flare.send(FLModel(params=m.params))
    mark(f"end-{rank}")
"""
)


def test_rank_0_asking_for_the_next_task_without_a_result_fails_the_task_naming_it(
    tmp_path, groups
):
    # FLARE's own Client API waits forever here (the executor waits for the result, the
    # script for the next task); the held task fails instead, and the group serves on.
    g = groups(tmp_path, FORGETS)
    reply = g.execute("train", {"w": np.ones(2, np.float32)}, round_=0)
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    error = reply.get_header("rankexec_error")
    print("reply header:", error)
    assert "TaskLeftUnanswered" in error
    assert "rank 0 asked for the next task without sending a result for task `train`" in error
    reply = g.execute("train", {"w": np.ones(2, np.float32)}, round_=1)
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK
    assert g.group.pids() == g.pids
    assert g.close()["escalated"] is None
    for r in (0, 1):
        assert (g.marks / f"end-{r}").exists()


LEAVES = (
    PREAMBLE
    + """
    import torch
    import torch.distributed as dist
    flare.init()
    if rank == 1:
        sys.exit(0)      # leaves at once, as FLARE's Lightning example's rank 1 did
    while flare.is_running():
        m = flare.receive()
        if m is None:   # a rank that does not receive (FLARE's semantics)
            continue
        mark("in-task")
        dist.init_process_group("gloo")   # waits for rank 1, which will never come
        flare.send(FLModel(params=m.params))
"""
)


def test_a_rank_whose_script_returns_while_the_run_goes_on_fails_the_group_naming_it(
    tmp_path, groups
):
    g = groups(tmp_path, LEAVES, restart={"max_restarts": 0})
    with pytest.raises(RankFailed) as info:
        g.group.execute("train", {"flare_model": {"current_round": 0}}, {})
    e = info.value
    print("reported:", e)
    assert e.rank == 1
    assert "rank 1's script returned while the run goes on" in str(e)
    assert g.close() is not None


def test_every_rank_is_sent_each_task_and_only_rank_0_s_result_counts(tmp_path):
    # Ranks other than 0 answer at once on their receiver thread (their is_running()
    # counts the tasks); tests/rank0_only.rs proves the policy with real ranks.
    for all_ranks in (False, True):
        executor = ScriptExecutor(
            script="custom/client.py", num_of_processes=2, all_ranks_receive=all_ranks
        )
        assert executor.group_config(str(tmp_path / "run"), str(tmp_path))["result"] == "rank0"
