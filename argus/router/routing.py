"""The router's routing state across plans (Argus §4.3–4.4 plus what replays showed it needs).

Between two plans the router keeps:

* the installed plan's scheduler (PASM sampling and Eq. 3 worker selection, with spill);
* the backlog signal: when queues exceed ``backlog_replan_per_worker`` per live worker, the
  allocator should re-plan now rather than at the next period (at most every
  ``min_replan_interval_s``).

The PASM has one owner, the allocator. The router samples the rows of the plan it installed
as they were published and never changes them: it runs no ODA and holds no histogram of its
own. Its classifications reach the allocator in every report (about once a second), where the
histogram H of all routers' prompts feeds the next plan; when the mix it sees overloads
levels, the router's queues grow and it asks the allocator for a plan through the backlog
signal rather than re-aligning locally. Why: with several routers, local re-alignment gave
each its own PASM built from its own 200 prompts, so no single component decided where load
went, and under the joint planner it replaced the program's per-class rows with ODA's answer
to a different question (``docs/router-internals.md`` has the history).

A prompt-agnostic router (PAC, Proteus) uses F itself as every PASM row.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace

from argus.router.config import RoutingConfig
from argus.router.scheduler import PromptScheduler, TimeOf
from argus.types import Plan, ProfileSet, RouteDecision, ShiftMap


class PlanRouter:
    """Routes prompts on the installed plan; one per router process."""

    def __init__(self, profiles: ProfileSet, rng: random.Random, config: RoutingConfig) -> None:
        self.profiles = profiles
        self.config = config
        self._rng = rng
        self._plan: Plan | None = None
        self._classes: Mapping[str, str] = {}
        self._scheduler: PromptScheduler | None = None
        self._installed_at = -math.inf

    @property
    def plan(self) -> Plan | None:
        return self._plan

    def install(self, plan: Plan, worker_classes: Mapping[str, str], now_s: float) -> None:
        """Follow ``plan`` from now on; ``worker_classes`` maps worker id → GPU class."""
        if not self.config.prompt_aware:
            plan = _prompt_agnostic(plan)
        self._plan = plan
        self._classes = dict(worker_classes)
        self._installed_at = now_s
        self._scheduler = self._build(plan)

    def route(
        self,
        optimal_level: int,
        queues: Mapping[str, int],
        down: AbstractSet[str],
        max_level: int | None = None,
        t_proc: TimeOf | None = None,
    ) -> RouteDecision:
        """Route one prompt whose classified level (for the plan's strategy) is given; no level
        above ``max_level`` (the request's minimum quality) is served; ``t_proc``: the
        request's measured service time per worker and level (default: the profile's)."""
        if self._scheduler is None:
            raise RuntimeError("no plan installed: install() comes before route()")
        return self._scheduler.route(optimal_level, queues, down, max_level, t_proc)

    def level_name(self, index: int) -> str:
        assert self._plan is not None
        return self._plan.allocation.levels[index]

    def wants_replan(self, now_s: float, queues: Mapping[str, int], down: AbstractSet[str]) -> bool:
        """True when queues have built up enough to re-plan before the next period."""
        if now_s - self._installed_at < self.config.min_replan_interval_s:
            return False
        live = max(1, len(queues) - len(down))
        return sum(queues.values()) > self.config.backlog_replan_per_worker * live

    def _build(self, plan: Plan) -> PromptScheduler:
        return PromptScheduler.from_plan(plan, self.profiles, self._classes, self._rng)


def _prompt_agnostic(plan: Plan) -> Plan:
    """The plan with every PASM row equal to the load shares F (routing ignores prompts)."""
    shares = plan.allocation.load_share_qpm
    total = sum(shares)
    if total <= 0.0:
        return plan
    row = tuple(share / total for share in shares)
    return replace(plan, shift_map=ShiftMap(plan.shift_map.levels, tuple(row for _ in shares)))
