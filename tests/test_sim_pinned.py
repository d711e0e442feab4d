"""A small seeded replay whose every per-request outcome is pinned: the simulator's speed-ups
must leave each policy's results as they were, request for request."""

import hashlib

import numpy as np
import pytest

from argus.profiles import default_profiles
from argus.profiles.synthetic_quality import synthetic_quality_table
from argus.sim.adapters import adapter_model_by_name
from argus.sim.arrivals import poisson
from argus.sim.classifiers import NoisyOracleClassifier
from argus.sim.cluster import GpuFailure, RetrievalFault, RunResult, SimConfig, Simulation
from argus.sim.policies import POLICIES, make_policy
from argus.types import Strategy

pytestmark = pytest.mark.unit


# sha256 (first 16 hex digits) of each policy's outcome below, taken before the speed-ups;
# pac and proteus again after the joint solver's shortcut (HighsOptions.shortcut_gap), which
# changes some of their plans on these 8 GPUs (with shortcut_gap=0 they are as before); the
# four planned policies again once they decide through the router's RouterPolicy, whose early
# admission refuses a request before it is classified (it then draws no PASM sample, so later
# draws shift): with the early check skipped, all four gave their earlier fingerprints;
# argus and argus-paper again once a K change of the model a worker is loading in the
# background keeps that load's ready time instead of starting it over (one physics for every
# policy, issue 30: a load costs the profile's load time, no more; argus-paper 27 model
# switches here before, 25 after); pac is as it was; argus, pac, proteus, sommelier and
# argus-paper again once a switch within the SD-1.x family loads only the UNet (issue 35: the
# profile's parts, priced by the allocator and charged by the simulator): with the profiles
# loaded as default:monolithic all eight give their earlier fingerprints; the four planned
# policies again once they plan with queueing caps measured on the simulator's service times
# (issue 30 item 3): with make_policy(..., caps="analytic") all four give their earlier ones;
# argus, pac and argus-paper again once the measured caps go past utilisation 0.99 where the
# queue hides a LoRA fetch (AC at K >= 10; proteus, SM only, is as it was); argus, pac and
# argus-paper again once a planner whose workers load in the background charges a load no
# forgone work (ControlConfig.background_loads) and argus and pac plan AC and SM each period
# (strategy choice ``best``); proteus and the unplanned policies are as they were; argus
# again once Q(v | c) is shrunk by how much the sample tells the classes apart
# (``calibration.shrunk_class_means``; the noisy oracle's Q is measured on the replay);
# argus, pac, proteus and argus-paper again once the router admits a request its chosen
# worker cannot finish in time on the nearest level that can (``spill_on_refusal``) and
# prices a worker still loading in the background at the level it still serves: with the
# spill off and the old pricing all eight give their earlier fingerprints; with the pricing
# alone only pac changes (to be7d668f7699e338); sommelier again once each GPU sizes its
# level under the queueing cap of a pool of one instead of at utilisation 1 (issue 30); argus
# again once the calibration's class shares fill its class histograms up to 100 prompts
# instead of the strategy in force being kept until 100 were classified
# (``ControlConfig.histogram_prior_prompts``)
PINNED = {
    "argus": "be4aa91574ae9e9a",
    "pac": "dd08f43d684bae36",
    "proteus": "2722ca31a545db18",
    "clipper-ha": "48c7cd24b03a241d",
    "clipper-ht": "f2f45ce88aa7e8f9",
    "sommelier": "1e4829ad2bac06b0",
    "nirvana": "ce5ae934ec4749c4",
    "argus-paper": "685938a2671ebb2d",
}


def fingerprint(result: RunResult) -> str:
    """Every per-request outcome and every counter, rounded to a microsecond / 1e-9."""
    digest = hashlib.sha256()
    for array in (result.finish_s, result.score, result.relative):
        digest.update(np.round(np.nan_to_num(array, nan=-1.0), 6).tobytes())
    for flags in (result.level, result.worker, result.refused):
        digest.update(np.asarray(flags, dtype=np.int64).tobytes())
    counters = (
        result.model_switches,
        result.plan_changes,
        result.strategy_switches,
        round(float(result.busy_s), 6),
        round(float(result.adapter_s), 6),
        *(round(float(t), 6) for t in result.switch_times_s),
        -1.0,
        *(round(float(t), 6) for t in result.plan_change_times_s),
        -1.0,
        *(round(float(b), 6) for b in result.busy_by_minute_s),
    )
    digest.update(repr(counters).encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def results() -> dict[str, RunResult]:
    profiles = default_profiles()
    workload = poisson(mean_qpm=120.0, duration_min=6, seed=3)
    quality = {
        s: synthetic_quality_table(
            workload.prompts, s, [lv.name for lv in profiles.levels_for(s)], seed=3
        )
        for s in Strategy
    }
    config = SimConfig.with_classes(
        {profiles.worker_classes[0]: 6, profiles.worker_classes[-1]: 2},
        faults=(GpuFailure(120.0, 200.0, 2), RetrievalFault(60.0, 100.0)),
        seed=3,
        adapters=adapter_model_by_name("katz"),
    )
    sim = Simulation(profiles, quality, workload, config)
    classifier = NoisyOracleClassifier(0.8, seed=3)
    return {name: sim.run(make_policy(name, classifier=classifier, seed=3)) for name in POLICIES}


@pytest.mark.parametrize("name", POLICIES)
def test_a_seeded_replay_gives_the_pinned_outcome(results: dict[str, RunResult], name: str) -> None:
    assert fingerprint(results[name]) == PINNED[name]
