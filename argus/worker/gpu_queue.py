"""The worker's GPU slot and the line of requests waiting for it.

One generation runs at a time (a diffusion model saturates its GPU; the paper finds batching
buys little, §4.4), so every request takes the one :class:`FifoSlot` before it runs and
releases it when its image is decoded. The slot is handed over in arrival order: the router
predicts a request's completion from the requests it sent ahead of it, which only holds when
they are served in that order.

:func:`wait_for_slot` is how a request waits: it gives up its place, without running, once its
:class:`~argus.worker.models.pipelines.CancelToken` says stop (the client went away, the
deadline passed) or once the time left is shorter than its predicted decode
(:class:`~argus.worker.decode_times.DecodeSkipped`), so that work nobody will wait for is not
done. The edit lane (:mod:`argus.worker.editing.lane`) takes the same slot in its turn.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from argus.worker.decode_times import DecodeSkipped, DecodeTimes
from argus.worker.models.pipelines import CancelToken

# how often a request waiting for the GPU looks at its token (client gone, deadline passed)
QUEUE_POLL_S = 0.05


class Ticket:
    """One request's place in the line for the GPU slot (:class:`FifoSlot`)."""

    __slots__ = ("granted", "turn")

    def __init__(self) -> None:
        self.granted = False  # the slot is this request's
        self.turn = threading.Event()  # set when it was handed the slot


class FifoSlot:
    """The GPU slot, handed to waiting requests in the order they arrived.

    A semaphore wakes whichever waiter polls first, so under a long queue some requests waited
    far longer than their place in line: the router predicts a request's completion from the
    requests ahead of it (it sends them in order), and on 2 tiny-model workers 16% of the
    requests it admitted at 3 × capacity with 30 s deadlines came back late. Here each request
    holds a :class:`Ticket` from :meth:`join` until it gets the slot or leaves the line
    (:meth:`leave`: cancelled, expired); :meth:`release` hands the slot to the oldest ticket.
    Thread-safe. ``with slot:`` waits for the slot without a deadline (the warm-up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._line: deque[Ticket] = deque()

    def join(self) -> Ticket:
        """A place at the end of the line (the slot at once when it is free and nobody
        waits)."""
        ticket = Ticket()
        with self._lock:
            if not self._busy and not self._line:
                self._busy = ticket.granted = True
                ticket.turn.set()
            else:
                self._line.append(ticket)
        return ticket

    def acquire(self, ticket: Ticket, timeout: float | None = None) -> bool:
        """Whether ``ticket`` has the slot, waiting at most ``timeout`` seconds for its turn."""
        return ticket.turn.wait(timeout)

    def leave(self, ticket: Ticket) -> None:
        """``ticket`` gives up its place; if the slot reached it meanwhile, it is passed on."""
        with self._lock:
            if not ticket.granted:
                self._line.remove(ticket)
                return
        self.release()

    def waiting(self) -> int:
        """Tickets in line for the slot (the edit lane drains its batch while any waits)."""
        with self._lock:
            return len(self._line)

    def release(self) -> None:
        """The slot's holder is done: the oldest waiting ticket gets it."""
        with self._lock:
            if self._line:
                ticket = self._line.popleft()
                ticket.granted = True
                ticket.turn.set()
            else:
                self._busy = False

    def __enter__(self) -> FifoSlot:
        self.acquire(self.join())
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def wait_for_slot(
    slot: FifoSlot,
    cancel: CancelToken,
    decode_times: DecodeTimes,
    waiting: Callable[[], None] | None = None,
    pixels: int = 0,
) -> None:
    """Take the GPU slot, or raise :class:`Cancelled` without it once ``cancel`` says stop
    (a request whose deadline passed in the queue is never run), or
    :class:`DecodeSkipped` once the time left before the deadline is shorter than the
    predicted decode of an image of ``pixels`` (predicted again at each poll: a decode
    that finished meanwhile may have changed it). ``waiting`` is called each time the wait
    polls without the slot."""
    ticket = slot.join()
    try:
        _wait_for_turn(slot, ticket, cancel, decode_times, waiting, pixels)
    except BaseException:
        slot.leave(ticket)  # hands the slot on if it was just handed to this one
        raise


def _wait_for_turn(
    slot: FifoSlot,
    ticket: Ticket,
    cancel: CancelToken,
    decode_times: DecodeTimes,
    waiting: Callable[[], None] | None,
    pixels: int,
) -> None:
    while True:
        cancel.check()
        remaining = cancel.remaining_s()
        decode_s = 0.0
        if remaining is not None and pixels:
            decode_s = decode_times.predict_s(pixels)
            if remaining < decode_s:
                raise DecodeSkipped(0, decode_s, remaining)
        wait = (
            QUEUE_POLL_S if remaining is None else min(QUEUE_POLL_S, max(remaining - decode_s, 0.0))
        )
        if slot.acquire(ticket, timeout=wait):
            break
        if waiting is not None:
            waiting()
    cancel.check()  # it may have expired while the slot was being handed over
