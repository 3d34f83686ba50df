"""``rankexec-flower-superexec`` and ``rankexec-flwr-clientapp``: Flower's SuperExec and
ClientApp process, with the message's arrays pulled into memory files.

Why: a node's peak memory on a model's arrival is set before any ``ClientApp`` runs:
Flower's ``flwr-clientapp`` holds the message as pulled ``bytes``, then inflated
``bytes``, while the SuperNode still holds its own copy (BENCHMARKS.md, "Flower's
node"). ``rankexec-flwr-clientapp`` is Flower's ``flwr-clientapp`` (its arguments, its
heartbeat, its error replies, its push of the reply: Flower's own code) with one step
replaced: the message is pulled by ``rankexec.flower._pull``, each chunk written into
its array's place in a memory file as it arrives. rankexec's ``ClientApp`` passes those
files to the node's ranks as they are. ``rankexec-flower-superexec`` is Flower's
``flower-superexec`` (same arguments) that launches ``rankexec-flwr-clientapp`` for each
ClientApp task instead of ``flwr-clientapp``.

A site runs it in place of the SuperExec the SuperNode would start itself::

    flower-supernode --isolation process --port 9094 ...   # the node, as before
    rankexec-flower-superexec --insecure --runtime-api-address 127.0.0.1:9094

Without ``--parent-pid`` it takes the SuperNode listening on that address's port as
its parent (found through ``/proc``, checked by its command line), so that it leaves
with the node and the node's rankexec host watches the node.

Caveats: any ClientApp runs under it, rankexec's or not; an array of more than one
chunk (5 MB, Flower's default) then has a read-only buffer as its ``data``, not
``bytes``: Flower's readers (``numpy()``, ``to_torch_state_dict()``...) take it, its
``Array`` constructor, ``copy.deepcopy`` and ``pickle`` do not (``bytes(arr.data)``
does). Only ``--executor subprocess`` (Flower's default) is taken. Flower
1.42's internals are patched by name (``TASK_TYPE_TO_COMMAND``, ``pull_task_input``,
``push_message``, ``push_task_output``: a ``Context``'s state is given ``bytes``, which
Flower's serialization takes only);
a Flower whose names differ is refused at start, naming what is missing.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rankexec.flower._supernode import flag, runtime_address, supernode_listening_on

__all__ = ["FlowerMismatch", "clientapp", "superexec"]

CLIENTAPP_COMMAND = "rankexec-flwr-clientapp"


class FlowerMismatch(RuntimeError):
    """The installed Flower lacks a name this module replaces."""


def _clientapp_command() -> str:
    here = Path(sys.executable).parent / CLIENTAPP_COMMAND
    if here.exists():
        return str(here)
    found = shutil.which(CLIENTAPP_COMMAND)
    if found is None:
        raise FlowerMismatch(
            f"{CLIENTAPP_COMMAND} is not installed next to {sys.executable} nor on PATH"
        )
    return found


def _with_parent(argv: list[str], wait_s: float = 30.0) -> list[str]:
    """``argv`` with ``--parent-pid`` of the SuperNode that serves its
    ``--runtime-api-address`` (on that address or a wildcard, checked by command line),
    where it names none: the SuperExec then leaves with its node. Waits up to ``wait_s``
    for the SuperNode to listen (a service started beside it). Left as it is for
    ``--help``/``--version``, and where the address is missing or not this machine's
    (Flower's own parsing then says what is wrong)."""
    if flag(argv, "--parent-pid") is not None or {"-h", "--help", "-V", "--version"} & set(argv):
        return argv
    found = runtime_address(argv)
    if found is None:
        return argv
    host, port = found
    deadline = time.monotonic() + wait_s
    while (pid := supernode_listening_on(port, host)) is None:
        if time.monotonic() > deadline:
            print(
                f"rankexec-flower-superexec: no flower-supernode of this machine listens on"
                f" {host}:{port}: running without --parent-pid (this SuperExec will not"
                " leave with it)",
                file=sys.stderr,
            )
            return argv
        time.sleep(0.25)
    return [*argv, "--parent-pid", str(pid)]


def _refused(command: str, e: FlowerMismatch) -> None:
    print(f"{command}: error: {e}", file=sys.stderr)
    sys.exit(2)


def superexec() -> None:
    """``flower-superexec`` that starts ``rankexec-flwr-clientapp`` for ClientApp tasks
    (``_superexec``); a ``FlowerMismatch`` is printed as one line, exit code 2."""
    try:
        _superexec()
    except FlowerMismatch as e:
        _refused("rankexec-flower-superexec", e)


def _superexec() -> None:
    """``flower-superexec`` that starts ``rankexec-flwr-clientapp`` for ClientApp tasks;
    without ``--parent-pid``, the SuperNode serving its Runtime API address is its
    parent (``_with_parent``)."""
    from flwr.supercore import constant
    from flwr.supercore.cli import flower_superexec

    commands = getattr(constant, "TASK_TYPE_TO_COMMAND", None)
    task = getattr(getattr(constant, "TaskType", None), "CLIENT_APP", None)
    if not isinstance(commands, dict) or task not in commands:
        raise FlowerMismatch("flwr.supercore.constant.TASK_TYPE_TO_COMMAND[CLIENT_APP]")
    executor = flag(sys.argv[1:], "--executor")
    if executor not in (None, "subprocess"):
        # Another executor runs the command elsewhere (a Kubernetes pod): this machine's
        # path would mean nothing there.
        raise FlowerMismatch(
            f"--executor {executor}: rankexec-flower-superexec starts ClientApp processes"
            " on this machine only (--executor subprocess)"
        )
    commands[task] = _clientapp_command()
    sys.argv = [sys.argv[0], *_with_parent(sys.argv[1:])]
    flower_superexec()


def pull_task_input(client: Any) -> tuple[Any, Any, Any, Any]:
    """Flower's ``pull_task_input`` (flwr/supernode/runtime/run_clientapp.py) with the
    message pulled into memory files (``rankexec.flower._pull``)."""
    from logging import INFO

    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore import log
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.task_identity import TaskIdentity

    from rankexec.flower._pull import pull_message

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)

    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message, in_files = pull_message(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
    )
    if in_files:
        log(INFO, "rankexec: %d arrays of the message pulled into memory files", in_files)
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


def clientapp() -> None:
    """``flwr-clientapp`` with Flower's steps replaced (``_clientapp``); a
    ``FlowerMismatch`` is printed as one line, exit code 2."""
    try:
        _clientapp()
    except FlowerMismatch as e:
        _refused("rankexec-flwr-clientapp", e)


def _clientapp() -> None:
    """``flwr-clientapp`` with ``pull_task_input`` and ``push_message`` replaced (see
    the module docs)."""
    from flwr.supernode.cli import flwr_clientapp
    from flwr.supernode.runtime import run_clientapp as runtime

    from rankexec.flower._codec import own_arrays
    from rankexec.flower._push import push_message

    for name in ("pull_task_input", "push_message", "push_task_output"):
        if not callable(getattr(runtime, name, None)):
            raise FlowerMismatch(f"flwr.supernode.runtime.run_clientapp.{name}")
    flowers_push_task_output = runtime.push_task_output

    def push_task_output(client: Any, context: Any, sub_status: str, details: str) -> None:
        # A state that kept received arrays holds memory files' views; Flower's
        # context_to_proto takes bytes only, and would drop the node's context.
        if context is not None:
            own_arrays(context.state)
        flowers_push_task_output(client, context, sub_status, details)

    runtime.pull_task_input = pull_task_input  # type: ignore[assignment]
    runtime.push_message = push_message  # type: ignore[assignment]
    runtime.push_task_output = push_task_output  # type: ignore[assignment]
    flwr_clientapp()
