"""A Python rank whose result is over the group's `max_frame`, over TCP: the rank knows
the limit from `Init`, refuses to send the frame, fails that task with a clear
protocol error, and lives on for the next task (same process, no relaunch)."""

from __future__ import annotations

import json
import subprocess

from conftest import BIN, COMPONENTS, REPO, env_with_python


def test_an_oversized_python_result_over_tcp_fails_the_task_not_the_rank(tmp_path):
    cfg = {
        "executor_id": "sized",
        "num_of_processes": 2,
        "max_frame": "1MiB",
        "transport": {"tcp": {"bind": "127.0.0.1:0"}},
        "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
        "components": [{"id": "sized", "path": f"{COMPONENTS}/echo.py:Sized", "args": {}}],
        "gpu": {"mode": "none"},
    }
    path = tmp_path / "executor.json"
    path.write_text(json.dumps(cfg))

    def run(n: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN), "run", "--config", str(path), "--task", "t", "--rounds", "2"]
            + ["--meta", json.dumps({"n": n})],
            cwd=REPO,
            env=dict(env_with_python(), RANKEXEC_LOG="info"),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    out = run(2_000_000)
    text = out.stdout + out.stderr
    rounds = [ln for ln in out.stdout.splitlines() if ln.startswith("round ")]
    print(*rounds, sep="\n")
    assert len(rounds) == 2, text[-3000:]
    for ln in rounds:
        assert "protocol: TaskResult is larger than the parent accepts" in ln, ln
        assert "frame body of 2000000 bytes exceeds the limit of 1048576" in ln, ln
    # The group was launched once and stopped once, by finalize: never torn down.
    assert text.count("rank group launched") == 1, text[-3000:]
    assert "reason=finalize" in text and "reason=a rank failed" not in text, text[-3000:]
    # Under the limit, the same configuration works.
    ok = run(1000)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert ok.stdout.count('"rank":0') == 2, ok.stdout
