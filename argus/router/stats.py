"""What the router's core tells about the requests it serves: :class:`RouterStats`.

:class:`~argus.router.core.RouterCore` hands each event to one listener as typed values and
never touches a metric itself; the listener decides what to keep. This base class keeps
nothing (tests, benchmarks and the simulator-like harnesses run without metrics); the router
process listens with :class:`argus.router.app.PrometheusStats`, which turns each event into
the ``argus_router_*`` series. Pure Python: the core imports this module and stays free of
prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from argus.router.cache_routing import CacheChoice
from argus.router.values import Refusal
from argus.types import Strategy


@dataclass(frozen=True)
class Served:
    """One request the router served."""

    level: str  # the level that served it
    strategy: Strategy
    classified: str  # the classifier's optimal level for its prompt
    total_s: float  # arrival until the answer
    worker_s: float  # the worker's own total
    late: bool  # later than the SLO


class RouterStats:
    """A listener that keeps nothing; subclasses override what they count."""

    def watch_in_flight(self, read: Callable[[], int]) -> None:
        """``read()`` is the number of requests being served, whenever the listener asks."""

    def plan_installed(self, version: int, strategy: Strategy, queues: Mapping[str, int]) -> None:
        """The router follows plan ``version`` now; its queue per worker of the plan."""

    def served(self, served: Served) -> None:
        """A request was answered with an image."""

    def failed(self, kind: Refusal, refusal_s: float | None) -> None:
        """A request was answered with ``kind``; ``refusal_s``: the core's own time on an
        overload refusal (None when the refusal was not the core's, or not timed)."""

    def rejected(self, reason: str) -> None:
        """A request was turned away before a worker saw it: "busy", "deadline", "ids"."""

    def classified(self, seconds: float) -> None:
        """A prompt was classified ``seconds`` after its request arrived."""

    def edit_placed(self, balancer: str, *, held: bool) -> None:
        """An inpainting edit was placed on a worker by ``balancer`` (a name of
        :data:`~argus.router.edit_balance.BALANCERS`); ``held``: that worker was believed to
        hold its template."""

    def spilled(self, target: str, served: str) -> None:
        """A request whose PASM target was level ``target`` was admitted at level ``served``
        instead: the worker routed to could not finish it in time and one there could."""

    def retried(self) -> None:
        """A request was routed again after its worker became unavailable."""

    def admitted_unserved(self) -> None:
        """An admitted request ended without its image for a reason not its caller's."""

    def id_evicted(self) -> None:
        """The request-id ledger dropped a kept answer to stay within its byte budget."""

    def http_answered(self, route: str, status: int) -> None:
        """The HTTP API answered ``route`` (one of its paths, or "other") with ``status``."""

    def watch_cache_entries(self, read: Callable[[], int]) -> None:
        """``read()`` is the number of cache entries the router mirrors, all workers."""

    def cache_embedded(self, seconds: float) -> None:
        """A prompt was embedded and looked up in the mirrored caches in ``seconds``."""

    def cache_routed(self, choice: CacheChoice) -> None:
        """An AC request's worker was chosen by what the caches hold: ``choice`` says which,
        the step its neighbour allows and whether Eq. 3 would have chosen another."""

    def cache_event_skipped(self, reason: str) -> None:
        """A worker's cache event was not applied to the mirror, for ``reason``
        (:data:`~argus.router.cache_mirror.SKIP_REASONS`)."""

    def cache_forgotten(self, reason: str) -> None:
        """A worker's mirrored entries were dropped, for ``reason``
        (:data:`~argus.router.cache_mirror.FORGET_REASONS`)."""


NO_STATS = RouterStats()
