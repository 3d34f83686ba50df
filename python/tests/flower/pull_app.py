"""A Flower app for the tests of ``rankexec-flower-superexec`` (test_pull_deployment.py,
test_page_commands.py): the ServerApp sends one node a model of three multi-chunk
arrays of random bytes and a small one, and writes what came back to the run config's
``result-file``: each array's SHA-256 as sent, what rank 0 saw (``seen``), whether the
reply is the model + 1 (``plus_one``), and, for each of the run config's ``rounds``
messages, the SHA-256 of the array ``a`` the node kept in ``context.state`` from the
message before (``kept``: ``""`` in the first). Every rank writes what it saw (each array's
SHA-256 and the type of its ``data``) to ``result-file.rank<RANK>``. ``impl``:
``rankexec`` (``rankexec.flower.ClientApp``, two ranks) or ``flower`` (Flower's own).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_app"]

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pullapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "rankexec"

[tool.flwr.app.components]
serverapp = "pullapp.server_app:app"
clientapp = "pullapp.client_app:app"

[tool.flwr.app.config]
result-file = ""
rounds = 1
"""

SERVER_APP = """\
import hashlib
import json

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.server import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rng = np.random.default_rng(5)
    model = {
        "a": rng.random((3_000_000,), dtype=np.float32),  # 12 MB: 3 chunks
        "b": rng.random((1000, 2600), dtype=np.float32),
        "c": rng.integers(0, 255, size=(11_000_000,), dtype=np.uint8),
        "bias": rng.random((64,), dtype=np.float32),
    }
    rec = ArrayRecord()
    for k, v in model.items():
        rec[k] = Array(v)
    digests = {k: hashlib.sha256(rec[k].data).hexdigest() for k in model}
    (node,) = list(grid.get_node_ids())
    out = {"digests": digests, "kept": []}
    for _ in range(int(context.run_config.get("rounds", 1))):
        msg = Message(RecordDict({"arrays": rec, "config": ConfigRecord({})}), node, "train")
        (reply,) = list(grid.send_and_receive([msg], timeout=600))
        if not reply.has_error():
            out["kept"].append(str(reply.content["seen"]["kept"]))
    if reply.has_error():
        out["error"] = reply.error.reason
    else:
        got = reply.content
        out["seen"] = json.loads(str(got["seen"]["json"])) if "seen" in got else None
        out["plus_one"] = all(
            np.array_equal(got["arrays"][k].numpy(), model[k] + 1)
            for k in ("a", "b", "bias")
        )
    with open(str(context.run_config["result-file"]), "w") as f:
        json.dump(out, f)
"""

CLIENT_APP = """\
import hashlib
import contextlib
import json
import os

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

{make_app}


@app.train()
def train(msg: Message, context: Context) -> Message:
    rec = msg.content["arrays"]
    seen = {{
        k: [hashlib.sha256(memoryview(a.data)).hexdigest(), type(a.data).__name__]
        for k, a in rec.items()
    }}
    state = rec.to_torch_state_dict()
    reply = ArrayRecord()
    reply_state = {{k: (state[k] + 1).numpy() for k in ("a", "b", "bias")}}
    for k, v in reply_state.items():
        reply[k] = __import__("flwr.app", fromlist=["Array"]).Array(v)
    # What the node kept of the message before (context.state persists per node): "a".
    kept = context.state["kept"]["a"].data if "kept" in context.state else None
    was_kept = hashlib.sha256(memoryview(kept)).hexdigest() if kept is not None else ""
    keep = ArrayRecord()
    keep["a"] = rec["a"]
    context.state["kept"] = keep
    rank = os.environ.get("RANK", "0")
    with open(str(context.run_config["result-file"]) + f".rank{{rank}}", "w") as f:
        json.dump(seen, f)
    said = ConfigRecord({{"json": json.dumps({{rank: seen}}), "kept": was_kept}})
    out = RecordDict({{"arrays": reply, "seen": said}})
    return Message(out, reply_to=msg)
"""

MAKE_APP = {
    "rankexec": 'from rankexec.flower import ClientApp\n\napp = ClientApp(num_of_processes=2, deadlines={"startup": "300s", "task": "300s"})',
    "flower": "from flwr.clientapp import ClientApp\n\napp = ClientApp()",
}


def write_app(root: Path, impl: str) -> Path:
    app = root / f"app-{impl}"
    pkg = app / "pullapp"
    pkg.mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text("")
    (pkg / "server_app.py").write_text(SERVER_APP)
    (pkg / "client_app.py").write_text(CLIENT_APP.format(make_app=MAKE_APP[impl]))
    return app
