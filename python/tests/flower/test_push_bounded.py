"""``rankexec.flower._push.push_bounded``: a reply's objects are deflated only as they
are sent, at most ``2 x workers`` deflated and unsent at any time (Flower's own
``push_objects`` deflates all of them first); the objects the SuperNode did not ask for
are skipped; the first failed push stops the rest and is raised."""

from __future__ import annotations

import threading
import time

import pytest

from rankexec.flower._push import push_bounded


class Counted:
    """An object whose deflation is counted (what each chunk's copy costs)."""

    lock = threading.Lock()

    def __init__(self, name: str, tally: dict[str, int]) -> None:
        self.name, self.tally = name, tally

    def deflate(self) -> bytes:
        with self.lock:
            self.tally["deflated"] += 1
            self.tally["most"] = max(
                self.tally["most"], self.tally["deflated"] - self.tally["sent"]
            )
        return self.name.encode() * 1000


def _objects(n: int, tally: dict[str, int]) -> dict[str, Counted]:
    return {f"o{i}": Counted(f"o{i}", tally) for i in range(n)}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_at_most_twice_the_workers_are_deflated_and_unsent(workers: int) -> None:
    tally = {"deflated": 0, "sent": 0, "most": 0}
    objects = _objects(200, tally)
    got: dict[str, bytes] = {}

    def push(object_id: str, content: bytes) -> None:
        time.sleep(0.001)  # a request's time: the producer runs ahead if it can
        with Counted.lock:
            got[object_id] = content
            tally["sent"] += 1

    wanted = {f"o{i}" for i in range(0, 200, 2)}
    assert push_bounded(objects, push, wanted, workers) == 100
    assert set(got) == wanted and all(got[k] == k.encode() * 1000 for k in got)
    assert tally["deflated"] == 100  # the unwanted were never deflated
    assert 1 <= tally["most"] <= 2 * workers, tally
    assert objects == {}


def test_the_first_failed_push_stops_the_rest_and_is_raised() -> None:
    tally = {"deflated": 0, "sent": 0, "most": 0}
    objects = _objects(500, tally)

    def push(object_id: str, content: bytes) -> None:
        if object_id == "o3":
            raise ConnectionError("the SuperNode went away")
        with Counted.lock:
            tally["sent"] += 1

    with pytest.raises(ConnectionError, match="went away"):
        push_bounded(objects, push, None, 2)
    assert tally["deflated"] < 500, tally  # stopped, not run to the end


def test_a_failure_is_raised_while_another_push_still_retries() -> None:
    """One push hangs (Flower's client retries a transport error without end), another
    fails for good: the failure is raised without waiting for the hung one, as Flower's
    own ``push_objects`` does."""
    tally = {"deflated": 0, "sent": 0, "most": 0}
    objects = _objects(50, tally)
    hung = threading.Event()
    outcome: list[BaseException] = []

    def push(object_id: str, content: bytes) -> None:
        if object_id == "o0":
            hung.wait(120)  # released by the test once it has its answer
        elif object_id == "o1":
            raise ConnectionError("the session expired")

    def run() -> None:
        try:
            push_bounded(objects, push, None, 2)
        except ConnectionError as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    try:
        assert not t.is_alive(), "push_bounded waited for the hung push"
        assert len(outcome) == 1 and isinstance(outcome[0], ConnectionError), outcome
    finally:
        hung.set()
