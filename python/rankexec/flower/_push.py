"""A reply pushed to the SuperNode with a bounded number of its objects deflated at once.

Why: Flower 1.42's ``push_objects`` hands its thread pool every object of the reply in
one list comprehension, so every chunk of every array is deflated (a header and a copy
of the chunk: new ``bytes``) before the first is sent: the ``flwr-clientapp`` process
holds the whole reply once more while the SuperNode receives it. Here each object is
deflated only when a worker is about to send it, with at most ``2 x workers`` deflated
and not yet sent; the reply's arrays stay where they are (rank 0's memory files,
mapped) and a chunk's copy lives for its one request.

Caveats: everything else is Flower's ``push_message``
(flwr/supernode/runtime/run_clientapp.py): the message and its object tree first, then
the objects the SuperNode asks for, with Flower's concurrency
(``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES``). The first failed push stops the rest and
is raised at once, without waiting for the pushes still in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

__all__ = ["push_bounded", "push_message"]


def push_bounded(
    objects: dict[str, Any],
    push_fn: Callable[[str, bytes], None],
    wanted: set[str] | None,
    workers: int,
) -> int:
    """Pushes ``objects`` (those in ``wanted``; all when ``None``), each deflated just
    before it is sent, at most ``2 x workers`` deflated at once; returns how many were
    pushed. ``objects`` is emptied as it goes."""
    workers = max(1, workers)
    room = threading.BoundedSemaphore(2 * workers)
    failed: list[BaseException] = []
    pushed = 0

    def push(object_id: str, content: bytes) -> None:
        try:
            if not failed:
                push_fn(object_id, content)
        except BaseException as e:  # the first failure stops the rest
            failed.append(e)
            raise
        finally:
            room.release()

    pool = ThreadPoolExecutor(workers, "rx-push")
    futures: list[Future[None]] = []
    try:
        for object_id in list(objects):
            obj = objects.pop(object_id)
            if wanted is not None and object_id not in wanted:
                continue
            room.acquire()
            if failed:
                room.release()
                break
            futures.append(pool.submit(push, object_id, obj.deflate()))
            pushed += 1
            del obj
        if not failed:
            # Until every push is done or one fails (not one by one: an earlier push
            # still retrying must not hide a later failure).
            wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        # After a failure, pushes still in flight (Flower's client retries without end)
        # are not waited for, as Flower's own push_objects does not wait.
        pool.shutdown(wait=not failed, cancel_futures=bool(failed))
    if failed:
        raise failed[0]
    return pushed


def push_message(client: Any, message: Any, context: Any) -> None:
    """Flower's ``push_message`` with ``push_bounded`` in place of ``push_objects``."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PushAppMessagesRequest
    from flwr.supercore.constant import FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
        no_object_id_recompute,
    )
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_push_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import get_num_workers

    message.metadata.__dict__["_message_id"] = message.object_id
    proto_message = message_to_proto(remove_content_from_message(message))
    with no_object_id_recompute():
        object_tree = get_object_tree(message)
        res = client.PushMessages(
            PushAppMessagesRequest(
                messages_list=[proto_message], message_object_trees=[object_tree]
            )
        )
        del proto_message
        objects = get_all_nested_objects(message)
        push_bounded(
            objects,
            make_push_object_fn_protobuf(
                client.PushObject,
                Node(node_id=context.node_id),
                run_id=context.run_id,
                session_id=res.session_id,
            ),
            set(res.objects_to_push),
            get_num_workers(FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES),
        )
