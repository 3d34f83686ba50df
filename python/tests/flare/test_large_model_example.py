"""examples/flare/large-model under the real `nvflare simulator`, small: an 8 MiB
GPT-2-shaped bfloat16 model, 2 rounds, 1 client x 2 ranks, every rank receiving the
model (`--share all`, rankexec's `all_ranks_receive`).

What it checks: the example's own `job.py` runs it (FLARE's Recipe API with
`use_rank_groups`, FLARE's `SimEnv`), as its README says; both ranks get every tensor as bfloat16 (no upcast on the way
in); the server's final model has the generator's names, shapes and dtype and equals
`initial + rounds * delta` exactly (rank 0 updated in bfloat16 and nothing upcast on the
way out); the whole model arrived in the memory files the ranks were sent, as FLARE
downloaded it (the site log); no error is logged; no rank outlives the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .flare_helpers import REPO, assert_no_errors, descendants, rank_pids, site_log

EXAMPLE = REPO / "examples" / "flare" / "large-model"
ROUNDS, DELTA = 2, 0.5


@pytest.fixture
def gpt_shape():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import gpt_shape

        yield gpt_shape
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("gpt_shape", None)


def test_generator_reaches_the_sizes_it_is_asked_for(gpt_shape):
    for size, dtype in ((8 << 20, "bfloat16"), (1 << 30, "float32"), (14 * 10**9, "bfloat16")):
        cfg = gpt_shape.config_for(size, dtype)
        got = gpt_shape.nbytes(**cfg)
        assert size - cfg["width"] * 4 <= got <= size, (size, dtype, cfg, got)
        names = [n for n, _ in gpt_shape.layout(**{k: cfg[k] for k in cfg if k != "dtype"})]
        assert names[:3] == ["wte.weight", "wpe.weight", "h.0.ln_1.weight"]
        assert names[-1] == "ln_f.bias"
        assert f"h.{cfg['layers'] - 1}.mlp.c_proj.weight" in names


def _run_example(argv: list[str], log: Path, cap: float) -> int:
    """`python job.py ARGV` in the example's folder, as its README says, in a session of
    its own: on the cap, it and everything below it are SIGKILLed and the test fails."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "job.py", *argv],
            cwd=EXAMPLE,
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
            pytest.fail(f"job.py did not finish within {cap} s:\n{log.read_text()[-4000:]}")


def test_bf16_model_round_trips_without_upcast(tmp_path, gpt_shape):
    import torch

    size = 8 << 20
    argv = ["--size", str(size), "--clients", "1", "--ranks", "2", "--rounds", str(ROUNDS)]
    argv += ["--delta", str(DELTA), "--share", "all", "--workspace", str(tmp_path / "sim")]
    log = tmp_path / "job.out"
    rc = _run_example(argv, log, cap=300)
    assert rc == 0, log.read_text()[-4000:]
    ws = tmp_path / "sim" / "large-model"
    assert_no_errors(ws)

    ranks = ws / "site-1" / "simulate_job" / "rankexec"
    cfg = gpt_shape.config_for(size, "bfloat16")
    shape = {k: cfg[k] for k in cfg if k != "dtype"}
    layout = gpt_shape.layout(**shape)
    for rank in (0, 1):
        text = (ranks / f"rank-{rank}" / "stdout.log").read_text()
        got = re.findall(r"received (\d+) tensors, (\d+) bytes, dtypes (\S+)", text)
        print(f"rank {rank}: {got}")
        assert got == [(str(len(layout)), str(gpt_shape.nbytes(**cfg)), "bfloat16")] * ROUNDS
    # FLARE's download wrote every tensor straight into the memory files the ranks were
    # sent (rankexec.flare._download): the whole model arrived there, each round.
    arrived = re.findall(
        r"task train: ([\d.]+) MiB arrived in memory files", site_log(ws, "site-1")
    )
    assert arrived == [f"{gpt_shape.nbytes(**cfg) / (1 << 20):.1f}"] * ROUNDS, arrived
    # Each round's result went back through FLARE's upload, every tensor of it (those
    # of 10 MiB and up: test_a_flat_models_result_goes_back_from_rank_0s_files).
    served = re.findall(
        r"result served: (\d+) items .* (\d+) \([\d.]+ MiB\) copied", site_log(ws, "site-1")
    )
    assert len(served) == ROUNDS, served
    for in_place, copied in served:  # from 1 MiB on from rank 0's files, the rest copied
        assert int(in_place) + int(copied) == len(layout), served

    saved = torch.load(
        ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False
    )
    model = saved.get("model", saved)
    assert list(model) == [n for n, _ in layout]
    for i, (name, dims) in enumerate(layout):
        t = model[name]
        assert t.dtype == torch.bfloat16, (name, t.dtype)
        assert tuple(t.shape) == dims, (name, t.shape)
        want = gpt_shape.initial_value(i) + ROUNDS * DELTA
        assert bool((t == want).all()), (name, t.flatten()[:4], want)
    print(f"server model: {len(model)} bfloat16 tensors, each initial + {ROUNDS} x {DELTA}")
    assert rank_pids(ws) == []


def test_a_flat_models_result_goes_back_from_rank_0s_files(tmp_path):
    # Tensors of 10 MiB and up (FLARE's datum threshold): FLARE's upload serves each
    # one from the memory file rank 0 sent it in, without a copy, every round.
    mib = 48
    argv = ["--size", f"{mib}MiB", "--layout", "flat", "--tensors", "4", "--clients", "1"]
    argv += ["--ranks", "2", "--rounds", str(ROUNDS), "--delta", str(DELTA)]
    argv += ["--workspace", str(tmp_path / "sim")]
    log = tmp_path / "job.out"
    rc = _run_example(argv, log, cap=300)
    assert rc == 0, log.read_text()[-4000:]
    ws = tmp_path / "sim" / "large-model"
    assert_no_errors(ws)
    served = re.findall(
        r"result served: (\d+) items \(([\d.]+) MiB\) from memory files, (\d+)",
        site_log(ws, "site-1"),
    )
    print(served)
    assert served == [("4", f"{mib:.1f}", "0")] * ROUNDS, served
    assert rank_pids(ws) == []
