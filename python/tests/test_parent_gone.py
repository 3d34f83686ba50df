"""A rank whose host disappears ends at once with `_exit`: no C `atexit` handler (nor a
library's static destructor) runs on a Rust thread while Python still runs on the
main thread."""

from __future__ import annotations

from conftest import Host, executor_config, pid_alive, read_notes, wait_until


def test_a_rank_whose_host_dies_runs_no_atexit_handler(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    # Under torchrun, ranks have no parent-death signal: they notice the host is gone
    # when its connections close.
    cfg = executor_config(
        "threads:CAtExit",
        2,
        {"out_dir": str(out)},
        log_dir=tmp_path,
        launcher={"torchrun": {}},
    )
    h = Host()
    try:
        started = h.start(cfg)
        assert started["ok"], started
        assert h.proc.stdin is not None
        h.proc.stdin.write('{"op": "task", "task": "spin"}\n')
        h.proc.stdin.flush()
        pids = [n["pid"] for n in read_notes(out, "spinning", 2, timeout=60)]
        h.proc.kill()
        h.proc.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "every rank gone")
    finally:
        if h.proc.poll() is None:
            h.proc.kill()
    ran = sorted(p.name for p in out.glob("c-atexit-*"))
    print("C atexit handlers that ran:", ran)
    assert ran == [], "a rank ran its atexit handlers while Python was still running"
