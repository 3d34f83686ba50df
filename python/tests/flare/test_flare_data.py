"""No data is dropped between FLARE and the ranks, under the real `nvflare simulator`:
a PyTorch-format model (torch tensors of several dtypes, a 0-d one among them, as
FLARE's PTFileModelPersistor sends them with `allow_numpy_conversion: false`) and a
`DataKind.COLLECTION` DXO (made by a client task-data filter) go to Python ranks that
add 1 to every array and tensor, and come back with the same kinds, dtypes and shapes.
"""

from __future__ import annotations

import json

from .flare_helpers import (
    assert_no_errors,
    client_config,
    rank_pids,
    run_sim,
    server_config,
    write_job,
)

PARTS = '''
import json
import os

import numpy as np
import torch
from torch import nn

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.filter import Filter
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey

import rankexec
from rankexec.flare.arrays import Member, pack_data, unpack_data


class MixedModel(nn.Module):
    """Parameters and buffers of several dtypes, one of them 0-d."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(4, 3))
            self.fc.bias.copy_(torch.zeros(4))
        self.h16 = nn.Parameter(torch.full((2, 2), 0.5, dtype=torch.float16))
        self.bf = nn.Parameter(torch.arange(4, dtype=torch.bfloat16))
        self.register_buffer("count", torch.arange(3, dtype=torch.int64))
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))


def describe(data):
    out = {}
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            out[k] = ["torch", str(v.dtype), list(v.shape), v.float().reshape(-1).tolist()]
        elif isinstance(v, np.ndarray):
            out[k] = ["numpy", v.dtype.str, list(v.shape), v.astype(float).reshape(-1).tolist()]
        elif isinstance(v, (DXO, Member)):
            out[k] = ["member", str(getattr(v.data_kind, "value", v.data_kind)),
                      describe(v.data), v.meta]
        else:
            out[k] = ["value", v]
    return out


def _dump(name, what):
    with open(os.path.join(os.environ["PROBE_DIR"], name), "w") as f:
        json.dump(what, f)


class AddOne:
    """Rank code: adds 1 to every array and tensor, members included."""

    def __init__(self, probe_dir):
        self.probe_dir = probe_dir

    def _add(self, data):
        out = {}
        for k, v in data.items():
            if isinstance(v, Member):
                out[k] = Member(v.data_kind, self._add(v.data), v.meta)
            elif isinstance(v, (torch.Tensor, np.ndarray)):
                out[k] = v + 1
            else:
                out[k] = v
        return out

    def execute(self, task, input, ctx, abort):
        data = unpack_data(input.meta, input.blobs)
        if ctx.rank == 0:
            path = os.path.join(self.probe_dir, f"rank-{ctx.get_prop('__identity_name__')}.json")
            with open(path, "w") as f:
                json.dump(describe(data), f)
        meta, blobs = pack_data(
            self._add(data), kind=input.meta["dxo_kind"], meta=input.meta.get("dxo_meta")
        )
        meta["NUM_STEPS_CURRENT_ROUND"] = 1
        return rankexec.Shareable(meta=meta, blobs=blobs)


class ResultProbe(FLComponent):
    """Server side: records every client result as it arrives."""

    def handle_event(self, event_type, fl_ctx):
        if event_type != EventType.BEFORE_PROCESS_SUBMISSION:
            return
        result = fl_ctx.get_prop(FLContextKey.TASK_RESULT)
        peer = fl_ctx.get_peer_context().get_identity_name()
        dxo = from_shareable(result)
        _dump(f"server-{peer}.json", {"kind": str(dxo.data_kind.value if hasattr(dxo.data_kind, "value") else dxo.data_kind), "data": describe(dxo.data)})


class ToCollection(Filter):
    """Client task-data filter: the model DXO becomes a member of a COLLECTION."""

    def process(self, shareable, fl_ctx):
        model = from_shareable(shareable)
        extra = DXO(
            DataKind.METRICS,
            {"hist": np.arange(5, dtype=np.int32), "note": "hi", "t": torch.tensor(2.5)},
            meta={"m": 1},
        )
        out = DXO(DataKind.COLLECTION, {"model": model, "extra": extra}, meta={"c": "x"})
        return out.update_shareable(shareable)


class FromCollection(Filter):
    """Client task-result filter: records the COLLECTION, hands the model on."""

    def process(self, shareable, fl_ctx):
        dxo = from_shareable(shareable)
        site = fl_ctx.get_identity_name()
        _dump(f"collection-{site}.json",
              {"kind": str(getattr(dxo.data_kind, "value", dxo.data_kind)),
               "meta": {k: v for k, v in dxo.meta.items() if k == "c"},
               "data": describe(dxo.data)})
        model = dxo.data["model"]
        model.meta.update({k: v for k, v in dxo.meta.items() if k != "c"})
        return model.update_shareable(shareable)
'''


def _pt_job(tmp_path, probe, collection: bool):
    server = server_config(num_rounds=1, error_logger=True)
    server["components"][0] = {
        "id": "persistor",
        "path": "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
        "args": {
            "model": {"path": "pt_parts.MixedModel", "args": {}},
            "allow_numpy_conversion": False,
        },
    }
    server["components"].append({"id": "probe", "path": "pt_parts.ResultProbe", "args": {}})
    client = client_config(
        {
            "num_of_processes": 2,
            "rank_component": "custom/pt_parts.py:AddOne",
            "rank_args": {"probe_dir": str(probe)},
            "server_expected_format": "pytorch",
        }
    )
    if collection:
        client["task_data_filters"] = [
            {"tasks": ["train"], "filters": [{"path": "pt_parts.ToCollection", "args": {}}]}
        ]
        client["task_result_filters"] = [
            {"tasks": ["train"], "filters": [{"path": "pt_parts.FromCollection", "args": {}}]}
        ]
    return write_job(
        tmp_path,
        "pt",
        {"app": {"server": server, "client": client, "files": {"custom/pt_parts.py": PARTS}}},
        {"app": ["@ALL"]},
    )


SENT = {
    "fc.weight": ["torch", "torch.float32", [4, 3], [float(i) for i in range(12)]],
    "fc.bias": ["torch", "torch.float32", [4], [0.0] * 4],
    "h16": ["torch", "torch.float16", [2, 2], [0.5] * 4],
    "bf": ["torch", "torch.bfloat16", [4], [0.0, 1.0, 2.0, 3.0]],
    "count": ["torch", "torch.int64", [3], [0.0, 1.0, 2.0]],
    "step": ["torch", "torch.int64", [], [7.0]],
}


def _plus_one(desc):
    return {k: [t, d, s, [x + 1 for x in v]] for k, (t, d, s, v) in desc.items()}


def test_a_pytorch_model_reaches_the_ranks_and_comes_back_as_tensors(tmp_path, monkeypatch):
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    job = _pt_job(tmp_path, probe, collection=False)
    ws = tmp_path / "ws"
    run_sim(job, ws)
    assert_no_errors(ws)
    for site in ("site-1", "site-2"):
        seen = json.loads((probe / f"rank-{site}.json").read_text())
        print(f"{site} rank 0 saw: {seen}")
        assert seen == SENT
        back = json.loads((probe / f"server-{site}.json").read_text())
        print(f"server got from {site}: {back}")
        assert back == {"kind": "WEIGHTS", "data": _plus_one(SENT)}
    assert rank_pids(ws) == []


def test_a_collection_reaches_the_ranks_and_comes_back_whole(tmp_path, monkeypatch):
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    job = _pt_job(tmp_path, probe, collection=True)
    ws = tmp_path / "ws"
    run_sim(job, ws)
    assert_no_errors(ws)
    extra_in = {
        "hist": ["numpy", "<i4", [5], [0.0, 1.0, 2.0, 3.0, 4.0]],
        "t": ["torch", "torch.float32", [], [2.5]],
        "note": ["value", "hi"],
    }
    for site in ("site-1", "site-2"):
        seen = json.loads((probe / f"rank-{site}.json").read_text())
        print(f"{site} rank 0 saw: {json.dumps(seen)[:400]}")
        assert seen == {
            "model": ["member", "WEIGHTS", SENT, seen["model"][3]],
            "extra": ["member", "METRICS", extra_in, {"m": 1}],
        }
        back = json.loads((probe / f"collection-{site}.json").read_text())
        print(f"{site} result collection: {json.dumps(back)[:400]}")
        extra_out = {
            "hist": ["numpy", "<i4", [5], [1.0, 2.0, 3.0, 4.0, 5.0]],
            "t": ["torch", "torch.float32", [], [3.5]],
            "note": ["value", "hi"],
        }
        assert back["kind"] == "COLLECTION" and back["meta"] == {"c": "x"}
        assert back["data"]["model"][:3] == ["member", "WEIGHTS", _plus_one(SENT)]
        assert back["data"]["extra"] == ["member", "METRICS", extra_out, {"m": 1}]
        server = json.loads((probe / f"server-{site}.json").read_text())
        assert server == {"kind": "WEIGHTS", "data": _plus_one(SENT)}
    assert rank_pids(ws) == []
