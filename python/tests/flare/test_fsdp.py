"""examples/flare/fsdp: FSDP2 training from the one memory file, under the real
`nvflare simulator` (2 clients x 2 ranks, 2 rounds, gloo on the CPU), and its shard
loader alone on 3 ranks (uneven shards).

What the simulation checks: the example's own `job.py` runs it (FLARE's `FedAvgRecipe`,
`use_rank_groups(..., all_ranks_receive=True)`, `SimEnv`), as its README says; every rank
of both sites received the model and took its shards from it in both rounds, trained and
ended at END_RUN (its loop left, `done` printed; the group stopped cooperatively, no
rank killed); the server's final model has `TinyGPT`'s names and shapes and differs from
the initial one (every weight matrix moved); no error is logged; no rank outlives the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import docrun
import pytest

from .flare_helpers import REPO, assert_no_errors, descendants, rank_pids, site_log

EXAMPLE = REPO / "examples" / "flare" / "fsdp"
ROUNDS, STEPS = 2, 3


@pytest.fixture
def tiny_gpt():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import tiny_gpt

        yield tiny_gpt
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("tiny_gpt", None)


def _run(argv: list[str], cwd: Path, log: Path, cap: float, **env: str) -> int:
    """`python ARGV` in `cwd` in a session of its own, with `env` added: on the cap, it
    and everything below it are SIGKILLed and the test fails."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, **env)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            return proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=30)
            pytest.fail(f"{argv} did not finish within {cap} s:\n{log.read_text()[-4000:]}")


def test_fsdp_job_trains_from_the_one_mapping(tmp_path, tiny_gpt):
    import torch

    size = 2 << 20  # the page's --size 2MiB; job.py's default --steps is STEPS
    # docs/sharded-training.md's command, as shown there (/tmp/ in tmp_path).
    (job,) = docrun.console("docs/sharded-training.md", "fsdp-job", tmp=tmp_path)
    rc, out = docrun.run(job, tmp_path / "job.out", 240)
    assert (why := job.check(rc, out)) is None, f"{why}:\n{out[-4000:]}"
    ws = tmp_path / "nvflare" / "fsdp" / "fsdp"
    assert_no_errors(ws)

    cfg = tiny_gpt.config_for(size)
    mib = 4 * tiny_gpt.num_params(cfg) / (1 << 20)
    for site in ("site-1", "site-2"):
        ranks = ws / site / "simulate_job" / "rankexec"
        for rank in (0, 1):
            text = (ranks / f"rank-{rank}" / "stdout.log").read_text()
            print(f"{site} rank {rank}:\n{text}")
            assert f"rank {rank}: gloo on cpu, world 2, load shards" in text
            loaded = re.findall(r"round (\d+): its shards of a ([\d.]+) MiB model \(shards\)", text)
            assert loaded == [(str(r), f"{mib:.1f}") for r in range(ROUNDS)], text
            trained = re.findall(r"round (\d+): loss ([\d.]+) -> ([\d.]+)", text)
            assert [r for r, _, _ in trained] == [str(r) for r in range(ROUNDS)], text
            assert re.search(rf"rank {rank}: done", text), text  # the loop ended at END_RUN
        assert "rank group stopped cooperatively" in site_log(ws, site)

    initial = tiny_gpt.TinyGPT(**cfg).state_dict()
    saved = torch.load(
        ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False
    )
    final = saved.get("model", saved)
    assert list(final) == list(initial)
    moved = []
    for name, t in initial.items():
        got = final[name]
        assert got.dtype == torch.float32 and got.shape == t.shape, (name, got.dtype, got.shape)
        assert bool(torch.isfinite(got).all()), name
        if not torch.equal(got, t):
            moved.append(name)
    weights = [n for n, t in initial.items() if t.dim() == 2 and not n.startswith(("tok", "pos"))]
    assert set(weights) <= set(moved), sorted(set(weights) - set(moved))
    print(f"server model: {len(final)} tensors as TinyGPT's, {len(moved)} changed")
    assert rank_pids(ws) == []


RANK_CODE = """
import mmap, os, sys
import numpy as np, torch, torch.distributed as dist
sys.path.insert(0, os.environ["EXAMPLE"])
from client import load_shards, sharded_model
from tiny_gpt import TinyGPT, config
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = config(vocab=250, width=64, layers=2, heads=2, positions=37, seed=3)
want = TinyGPT(**cfg).state_dict()
# The full tensors as every rank of a group receives them: copy-on-write views of one file.
with open(os.environ["MODEL_FILE"], "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
flat, full, at = np.frombuffer(mapped, dtype=np.float32), {}, 0
for name, t in want.items():
    full[name] = torch.from_numpy(flat[at : at + t.numel()]).view(t.shape)
    at += t.numel()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for how in ("shards", "dsd", "view"):  # "view" last: its writes show in `full`
    model = sharded_model(cfg, mesh)
    if how == "dsd":
        set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
    else:
        load_shards(model, full, torch.device("cpu"), copy=how == "shards")
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), want[name]), (how, name)
    tokens = torch.randint(0, 250, (2, 17))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert (list(got) == list(want)) if rank == 0 else got == {}, (how, rank, list(got)[:3])
    # The optimizer's writes stayed in the rank: the file still holds the initial model
    # (with "view" the rank's own views of it show its writes: they are its shards).
    on_disk = torch.from_numpy(np.fromfile(os.environ["MODEL_FILE"], dtype=np.float32))
    assert torch.equal(on_disk, torch.cat([t.flatten() for t in want.values()])), how
    assert all(torch.equal(full[n], want[n]) for n in want) == (how != "view"), how
    print(f"rank {rank}: {how} ok", flush=True)
dist.destroy_process_group()
"""


def test_shard_loader_gives_every_rank_its_part_of_uneven_tensors(tmp_path, tiny_gpt):
    """3 ranks, dims that 3 does not divide (vocab 250, 37 positions): each way of
    loading gives FSDP2 exactly the full tensors back, training runs, the gather reaches
    rank 0 alone, and what the ranks wrote never reaches the shared file."""
    cfg = tiny_gpt.config(vocab=250, width=64, layers=2, heads=2, positions=37, seed=3)
    model_file = tmp_path / "model.bin"
    with open(model_file, "wb") as f:
        f.writelines(t.numpy().tobytes() for t in tiny_gpt.TinyGPT(**cfg).state_dict().values())
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_CODE))
    log = tmp_path / "ranks.out"
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script)]
    env = {"EXAMPLE": str(EXAMPLE), "MODEL_FILE": str(model_file), "OMP_NUM_THREADS": "1"}
    rc = _run(argv, tmp_path, log, cap=120, **env)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    for rank in range(3):
        for how in ("shards", "dsd", "view"):  # "view" last: its writes show in `full`
            assert f"rank {rank}: {how} ok" in out, out[-4000:]
