"""What the router believes of each worker (:class:`WorkerBeliefs`): counted as requests are
sent and answered, kept across plans for the workers a new plan still names, forgotten for the
others, and a down mark kept for a worker that left the plan in case it comes back."""

from __future__ import annotations

import pytest

from argus.router.worker_beliefs import WorkerBeliefs

pytestmark = pytest.mark.unit

ADDRESSES = {"w1": "w1:1", "w2": "w2:1", "w3": "w3:1"}
CLASSES = {"w1": "gpu-a", "w2": "gpu-b", "w3": "gpu-a"}


def beliefs(levels: dict[str, int] | None = None) -> WorkerBeliefs:
    held = WorkerBeliefs()
    held.install(ADDRESSES, {"w2": 1, "w1": 0} if levels is None else levels, CLASSES)
    return held


def test_a_plan_gives_each_worker_its_address_level_and_class_in_the_plans_order() -> None:
    held = beliefs()
    assert list(held.levels.items()) == [("w2", 1), ("w1", 0)]  # the plan's order, not by id
    assert held.address("w3") == "w3:1" and held.addresses() == set(ADDRESSES.values())
    assert held.gpu_class("w2") == "gpu-b" and held.planned("w1") and not held.planned("w3")
    with pytest.raises(KeyError):
        held.gpu_class("w3")  # live, but the plan assigns it no level
    assert held.has_workers() and not WorkerBeliefs().has_workers()


def test_a_queue_counts_requests_sent_and_not_answered_and_its_head_starts_as_one_ends() -> None:
    held = beliefs()
    assert held.elapsed_s("w1", 5.0) == 0.0  # never sent a request
    held.sent("w1", 1.0)
    held.sent("w1", 2.0)  # behind the first: the head still began at 1
    assert held.queues() == {"w1": 2, "w2": 0, "w3": 0}
    assert held.elapsed_s("w1", 4.0) == 3.0
    held.answered("w1", 6.0)  # the next one started as this one ended
    assert held.queues()["w1"] == 1 and held.elapsed_s("w1", 7.0) == 1.0
    held.answered("w1", 8.0)
    held.answered("w1", 9.0)  # nothing left to answer: no negative queue
    assert held.queues()["w1"] == 0


def test_a_worker_finishing_abandoned_work_counts_one_more_until_then() -> None:
    held = beliefs()
    held.abandoned("w1", now=1.0, until=3.0)
    held.abandoned("w1", now=1.5, until=2.0)  # an earlier end does not shorten it
    assert held.queue_view(2.5) == {"w1": 1, "w2": 0, "w3": 0}
    assert held.queue_view(3.0) == {"w1": 0, "w2": 0, "w3": 0}
    assert held.queues()["w1"] == 0  # the report's queues count sent requests only


def test_a_new_plan_keeps_what_is_believed_of_the_workers_it_names_and_forgets_the_rest() -> None:
    held = beliefs()
    held.sent("w1", 1.0)
    held.mark_down("w2", until=10.0)
    held.replied("w1", "ac-k5")
    held.install({"w1": "w1:2", "w3": "w3:1"}, {"w1": 1, "w3": 0}, CLASSES)
    assert held.queues() == {"w1": 1, "w3": 0}
    assert held.address("w1") == "w1:2" and held.answered_level("w1") == "ac-k5"
    assert held.down(5.0) == set()  # w2 left the plan, and its down mark with it
    with pytest.raises(KeyError):
        held.address("w2")


def test_a_worker_marked_down_after_it_left_the_plan_is_still_down_when_it_returns() -> None:
    held = beliefs()
    held.install({"w1": "w1:1"}, {"w1": 0}, CLASSES)  # w2 leaves while serving a request
    held.mark_down("w2", until=10.0)  # ... which then fails UNAVAILABLE
    assert held.down(5.0) == {"w2"}  # counted down (the backlog signal's live count) ...
    assert held.queues() == {"w1": 0}  # ... but not a worker of the plan
    with pytest.raises(KeyError):
        held.address("w2")
    held.install({"w1": "w1:1", "w2": "w2:1"}, {"w1": 0, "w2": 0}, CLASSES)
    assert held.down(5.0) == {"w2"} and held.down(10.0) == set()
    assert held.queues() == {"w1": 0, "w2": 0}
