"""Payloads without copies: one memory file for every rank; outputs built in place."""

from __future__ import annotations

from conftest import executor_config, read_notes

MIB = 1 << 20


def test_64mib_input_reaches_4_ranks_as_the_same_memory(host, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    cfg = executor_config("ranks:Probe", 4, {"out_dir": str(out)}, log_dir=tmp_path)
    assert host.start(cfg)["ok"]
    r = host.send(
        op="task", task="look", meta={"torch": True}, blobs={"x": {"len": 64 * MIB, "byte": 42}}
    )
    assert r["ok"], r
    host_inode = r["input_inodes"]["x"]
    notes = read_notes(out, "look", 4)
    for n in notes:
        print("rank saw:", n)
    assert host_inode is not None
    assert {n["inode"] for n in notes} == {host_inode}, "every rank maps the host's file"
    assert len({n["pid"] for n in notes}) == 4
    for n in notes:
        assert n["shared"] and n["nbytes"] == 64 * MIB
        assert n["same_pointer"], "np.frombuffer points into the mapping itself"
        assert n["torch_same_pointer"], "so does torch.frombuffer"
        assert not n["writeable"], "the input is read-only"
        assert (n["first"], n["last"]) == (42, 42)


def test_output_built_in_shared_memory_comes_back_without_a_copy(host, tmp_path):
    cfg = executor_config("ranks:Probe", 2, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    assert host.start(cfg)["ok"]
    r = host.send(op="task", task="make", meta={"nbytes": 32 * MIB})
    print("output:", r["blobs"], r["meta"])
    assert r["ok"], r
    y = r["blobs"]["y"]
    assert y["shared"] and y["len"] == 32 * MIB
    assert y["inode"] == r["meta"]["inode"], "the host holds the rank's own memory file"
    assert (y["first"], y["last"]) == (7, 9)
