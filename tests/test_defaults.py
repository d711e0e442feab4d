"""Each default is written once: a command's flags, the process settings they fill, the
configs those build, ``argus up``'s cluster spec, the Helm chart's values and the simulator
all agree, and each default ``argus.defaults`` holds is what every config that shares its
concept defaults to.

The flags' defaults are read from the real parsers (``argus.cli.main`` builds them the same
way), with no ``--help``: whatever a flag defaults to must be what the settings field it maps
to defaults to, so a default changed in one place and not the other fails here. The SLO rule's
users are called with :data:`argus.defaults.SLO_FACTOR` patched to another factor and a profile
whose classes differ, so a site that computes the SLO itself fails here.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from argus import defaults
from argus.allocator.app import AllocatorSettings
from argus.allocator.config import ControlConfig
from argus.cli.main import COMMANDS, OneLineParser, config_error, load_command
from argus.profiles import default_profiles
from argus.router.app import RouterSettings
from argus.router.config import RouterServiceConfig
from argus.slo import default_slo_s
from argus.tools.local_cluster import ClusterSpec
from argus.types import ProfileSet, Strategy

pytestmark = pytest.mark.unit


ROOT = Path(__file__).resolve().parent.parent
ALLOCATOR = "127.0.0.1:50052"  # a required flag's value: not a default


def parser_defaults(command: str) -> dict[str, Any]:
    """Every flag's default of ``argus <command>``: dest → value."""
    assert command in COMMANDS
    parser = OneLineParser(prog=f"argus {command}")
    load_command(command).add_arguments(parser)
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}


def field_defaults(settings: Any) -> dict[str, Any]:
    """The settings instance's fields, by name."""
    return dict(vars(settings))


def mismatches(
    flags: dict[str, Any],
    fields: dict[str, Any],
    renamed: dict[str, str] | None = None,
    own: frozenset[str] = frozenset(),
) -> list[tuple[str, Any, Any]]:
    """(flag dest, flag default, field default) for each flag that maps to a field (by name,
    or through ``renamed``: dest → field) and defaults to something else. ``own``: flags whose
    value is the caller's to give (required ones, paths), not a default."""
    out = []
    for dest, default in flags.items():
        name = (renamed or {}).get(dest, dest)
        if dest in own or name not in fields:
            continue
        value = tuple(default) if isinstance(default, list) else default  # repeatable flags
        if fields[name] != value:
            out.append((dest, default, fields[name]))
    return out


def allocator_fields(settings: AllocatorSettings) -> dict[str, Any]:
    """The allocator's settings with its control config's fields (and the retrieval config's,
    as ``retrieval_<field>``) beside them, named as its flags name them."""
    control = settings.control
    retrieval = {f"retrieval_{k}": v for k, v in field_defaults(control.retrieval).items()}
    return field_defaults(settings) | field_defaults(control) | retrieval


def test_allocator_flags_default_to_the_settings_and_the_settings_to_the_control() -> None:
    flags = parser_defaults("allocator")
    settings = AllocatorSettings()
    assert mismatches(flags, allocator_fields(settings)) == []
    assert {"period_s", "heartbeat_s", "max_watchers", "retrieval_window_s"} <= set(flags)
    # each flag has a field (--insecure-internal only confirms that no TLS dir is given)
    assert set(flags) - {"insecure_internal"} <= set(allocator_fields(settings))
    assert settings.control == ControlConfig()  # nothing the process defaults differently


def test_router_flags_default_to_the_settings_and_the_settings_to_the_service() -> None:
    flags = parser_defaults("router")
    settings = RouterSettings(allocator=ALLOCATOR)
    fields = field_defaults(settings) | field_defaults(settings.service)
    assert mismatches(flags, fields, own=frozenset({"allocator"})) == []
    assert {"report_period_s", "default_deadline_ms", "max_in_flight"} <= set(flags)
    assert settings.service == RouterServiceConfig()


def test_router_drift_flags_default_to_the_drift_configs() -> None:
    from argus.cli.router import drift_settings
    from argus.router.drift import DriftSettings

    parser = OneLineParser(prog="argus router")
    load_command("router").add_arguments(parser)
    args = parser.parse_args(["--allocator", ALLOCATOR])
    assert drift_settings(args) == DriftSettings()  # window, tolerance, retrain, min labels


def test_worker_flags_default_to_the_settings_and_the_settings_to_the_engine() -> None:
    from argus.worker.adapters.workflow import AdapterSettings
    from argus.worker.app import WorkerSettings
    from argus.worker.engine import WorkerConfig

    flags = parser_defaults("worker")
    settings = WorkerSettings()
    fields = field_defaults(settings) | field_defaults(AdapterSettings())
    assert mismatches(flags, fields) == []
    assert flags["no_cache"] is (not settings.cache)
    engine = WorkerConfig()
    assert (engine.default_width, engine.default_height) == (settings.default_size,) * 2
    assert engine.default_steps == settings.default_steps
    assert engine.max_queue == settings.max_queue
    assert engine.worker_id == settings.worker_id


def test_controlnet_flags_default_to_the_settings() -> None:
    from argus.worker.adapters.controlnet.app import ControlNetSettings

    flags = parser_defaults("controlnet")
    settings = ControlNetSettings()
    # --cache-size unset means the service's default, which run() passes on
    assert mismatches(flags, field_defaults(settings), own=frozenset({"cache_size"})) == []
    assert {"max_sessions", "policy", "preload"} <= set(flags)


def test_argus_up_defaults_to_the_cluster_spec_and_the_spec_to_the_services() -> None:
    flags = parser_defaults("up")
    spec = ClusterSpec(workdir=Path("unused"))
    renamed = {"steps": "default_steps", "http_port": "router_http_port"}
    # --port is the well-known router port (a spec built by tests picks a free one);
    # --workdir is a temp dir when not given
    own = frozenset({"port", "workdir"})
    assert mismatches(flags, field_defaults(spec), renamed, own) == []
    assert {"workers", "steps", "period_s", "http_port"} <= set(flags)
    allocator = allocator_fields(AllocatorSettings())
    for name in ("period_s", "heartbeat_s", "retrieval_threshold_s", "retrieval_window_s"):
        assert getattr(spec, name) == allocator[name], name
    from argus.worker.app import WorkerSettings

    assert spec.default_size == WorkerSettings().default_size
    from argus.plumbing.supervision import RestartPolicy

    assert flags["max_restarts"] == RestartPolicy().max_deaths


def test_argus_plan_plans_for_the_allocators_period() -> None:
    assert parser_defaults("plan")["period"] == ControlConfig().period_s


def allocator_config_fields() -> dict[str, set[str]]:
    """Every config or settings dataclass of ``argus/allocator/*.py`` (by its qualified name)
    → its field names."""
    import importlib
    import pkgutil
    from dataclasses import fields, is_dataclass

    import argus.allocator

    found: dict[str, set[str]] = {}
    for info in pkgutil.iter_modules(argus.allocator.__path__, "argus.allocator."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and is_dataclass(value)
                and value.__module__ == module.__name__
                and name.endswith(("Config", "Settings"))
            ):
                found[f"{module.__name__}.{name}"] = {f.name for f in fields(value)}
    return found


def test_the_planning_period_is_one_field() -> None:
    """Only the allocator's ControlConfig holds ``period_s``: a second config field could
    disagree with it, and the planner and the forecast would count different periods."""
    configs = allocator_config_fields()
    assert {
        "argus.allocator.config.ControlConfig",
        "argus.allocator.planner.PlannerConfig",
        "argus.allocator.predictor.LoadPredictorConfig",
        "argus.allocator.app.AllocatorSettings",
    } <= set(configs)  # the scan sees the configs
    holders = sorted(name for name, names in configs.items() if "period_s" in names)
    assert holders == ["argus.allocator.config.ControlConfig"]


def test_the_planning_period_reaches_the_forecast_and_the_planner() -> None:
    from argus.allocator.allocator import Allocator
    from argus.allocator.planner import make_plan
    from argus.sim.cluster import SimConfig
    from argus.types import ClusterView, WorkerState

    assert ControlConfig().period_s == defaults.PLANNING_PERIOD_S == SimConfig().period_s
    profiles = default_profiles()
    # workers that stop while loading: a load is charged what it forgoes
    control = ControlConfig(period_s=17.0, backlog_drain_s=0.0, background_loads=False)
    allocator = Allocator(profiles, control)
    for i in range(17):  # 17 arrivals in the first 8.5 s
        allocator.observe_arrival(0.5 * i)
    # periods of 17 s: the first one, closed, counted 60 QPM; in periods of 60 s the open
    # one's 17 arrivals over 25.5 s would read as 40 QPM
    assert allocator.forecast(25.5).qpm == pytest.approx(60.0)
    # the plan amortises its switching cost over the same 17 s: the workers hold SDXL, and
    # each one that loads another model costs weight × load time / period
    sdxl = profiles.levels_for(Strategy.SM)[0].name
    view = ClusterView(
        tuple(WorkerState(f"w{i}", profiles.worker_classes[0], level=sdxl) for i in range(4))
    )
    plan = allocator.plan(25.5, view, Strategy.SM)
    histogram = (1.0,) * len(profiles.levels_for(Strategy.SM))  # nothing classified: uniform
    config = control.planner_config(profiles)

    def objective(period_s: float) -> float:
        again = make_plan(
            profiles, Strategy.SM, view, plan.forecast, histogram, config=config, period_s=period_s
        )
        return again.allocation.objective

    assert plan.allocation.objective == pytest.approx(objective(17.0))
    assert objective(17.0) != pytest.approx(objective(defaults.PLANNING_PERIOD_S))


# -- the SLO rule --------------------------------------------------------------------------------


def h100_first() -> ProfileSet:
    """The default profiles with the faster class first and its speed not a round number: the
    services' SLO (first class) and the simulator's (slowest class present) differ on it."""
    profiles = default_profiles().with_speed({"h100": 1.3})
    return replace(profiles, worker_classes=("h100", "a100"))


@pytest.fixture
def factor(monkeypatch: pytest.MonkeyPatch) -> float:
    """:data:`argus.defaults.SLO_FACTOR` patched to 2.5: a site that multiplies by its own 3
    (or reads another constant) now disagrees with the rule."""
    monkeypatch.setattr(defaults, "SLO_FACTOR", 2.5)
    return 2.5


def test_the_slo_rule_is_the_factor_times_the_slowest_classes_best_latency(factor: float) -> None:
    profiles = h100_first()
    assert default_slo_s(profiles, ["h100"]) == pytest.approx(2.5 * 1.3 * 2.1)
    assert default_slo_s(profiles, ["h100", "a100"]) == pytest.approx(2.5 * 4.2)
    assert default_slo_s(profiles, ["a100"], factor=4.0) == pytest.approx(4.0 * 4.2)
    with pytest.raises(ValueError, match="classes"):
        default_slo_s(profiles, [])


def test_the_allocator_and_the_router_default_to_the_rule_on_the_first_class(
    factor: float,
) -> None:
    profiles = h100_first()
    expected = default_slo_s(profiles, ["h100"])
    assert ControlConfig().slo_for(profiles) == pytest.approx(expected)
    assert RouterServiceConfig().slo_for(profiles) == pytest.approx(expected)
    queue = ControlConfig().planner_config(profiles).queue
    assert queue is not None and queue.slo_s == pytest.approx(expected)


def test_argus_plan_plans_against_the_rule(
    factor: float, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from argus.cli.main import main

    assert main(["plan", "--load", "60"]) == 0
    profiles = default_profiles()
    expected = default_slo_s(profiles, profiles.worker_classes[:1])
    assert json.loads(capsys.readouterr().out)["slo_s"] == pytest.approx(expected)
    assert expected == pytest.approx(2.5 * 4.2)


def test_the_live_replay_judges_by_the_simulators_slo(factor: float) -> None:
    from argus.sim.cluster import SimConfig
    from argus.tools.live import simulator_slo_s

    profiles = h100_first()
    classes = [name for name, _ in SimConfig().worker_counts()]
    assert simulator_slo_s(profiles) == pytest.approx(default_slo_s(profiles, classes))
    assert simulator_slo_s(profiles) == pytest.approx(2.5 * 4.2)  # the default cluster: a100s


def test_the_simulator_judges_by_the_rule_on_its_slowest_class() -> None:
    from argus.profiles.synthetic_quality import synthetic_quality_table
    from argus.sim.arrivals import poisson
    from argus.sim.cluster import SimConfig, Simulation

    assert SimConfig().slo_factor == defaults.SLO_FACTOR
    profiles = h100_first()
    workload = poisson(60.0, 1.0, seed=0)
    quality = {
        s: synthetic_quality_table(workload.prompts, s, [v.name for v in profiles.levels_for(s)])
        for s in (Strategy.AC, Strategy.SM)
    }
    config = SimConfig.with_classes({"h100": 2, "a100": 2}, slo_factor=2.5)
    simulation = Simulation(profiles, quality, workload, config)
    assert simulation.slo_s == pytest.approx(default_slo_s(profiles, ["h100", "a100"], 2.5))
    assert simulation.slo_s == pytest.approx(2.5 * 4.2)


# -- δ, the histogram window, image and id limits ------------------------------------------------


def parameter_default(function: Any, name: str) -> Any:
    return inspect.signature(function).parameters[name].default


def test_every_delta_is_the_one_delta() -> None:
    from argus.classifier.drift import ScoredPrompts
    from argus.classifier.evaluate import evaluate
    from argus.classifier.labels import labels_from_table
    from argus.contracts.quality import DEFAULT_DELTA, QualityTable
    from argus.profiles.synthetic_quality import calibration_report
    from argus.router.drift import DriftSettings

    assert DEFAULT_DELTA == defaults.DELTA
    assert parameter_default(QualityTable.optimal_levels, "delta") == defaults.DELTA
    assert parameter_default(ScoredPrompts.__init__, "delta") == defaults.DELTA
    assert parameter_default(evaluate, "delta") == defaults.DELTA
    assert parameter_default(labels_from_table, "delta") == defaults.DELTA
    assert parameter_default(calibration_report, "delta") == defaults.DELTA
    assert DriftSettings().delta == defaults.DELTA
    assert parser_defaults("train-classifier")["delta"] == defaults.DELTA


def test_every_class_histogram_looks_back_over_the_one_window() -> None:
    from argus.allocator.predictor import AffinityHistogram, histogram_l2_error

    assert ControlConfig().histogram_window == defaults.HISTOGRAM_WINDOW
    assert parameter_default(AffinityHistogram.__init__, "window") == defaults.HISTOGRAM_WINDOW
    assert parameter_default(histogram_l2_error, "window") == defaults.HISTOGRAM_WINDOW


def test_the_router_and_the_worker_serve_the_same_largest_image() -> None:
    from argus.request_limits import ImageLimits
    from argus.worker.engine import WorkerConfig

    limits = ImageLimits()
    assert (limits.max_side, limits.max_pixels) == (
        defaults.MAX_IMAGE_SIDE,
        defaults.MAX_IMAGE_PIXELS,
    )
    worker = WorkerConfig()
    assert (worker.max_side, worker.max_pixels) == (limits.max_side, limits.max_pixels)
    assert RouterServiceConfig().limits == limits


def test_id_limits_each_have_one_home() -> None:
    from argus.contracts import wire
    from argus.router import core, drift

    assert core.MAX_ID_CHARS == defaults.MAX_REQUEST_ID_CHARS  # a client's request id
    assert wire.MAX_ID_CHARS == defaults.MAX_WIRE_ID_CHARS  # names in internal messages
    assert drift.MAX_KEY_CHARS == defaults.MAX_WIRE_ID_CHARS  # a report's classifier key


def test_the_simulators_planned_policies_run_the_allocators_defaults() -> None:
    from argus.sim.planned import PlannedConfig

    assert PlannedConfig().control == ControlConfig()


# -- the Helm chart ------------------------------------------------------------------------------

# chart value (component, key) → (command, flag dest): the values the chart always passes as
# flags, so a chart installed with its defaults runs what the binaries default to
HELM_FLAGS = {
    ("allocator", "periodSeconds"): ("allocator", "period_s"),
    ("allocator", "heartbeatSeconds"): ("allocator", "heartbeat_s"),
    ("allocator", "retrievalThresholdSeconds"): ("allocator", "retrieval_threshold_s"),
    ("allocator", "retrievalWindowSeconds"): ("allocator", "retrieval_window_s"),
    ("allocator", "maxWorkers"): ("allocator", "max_workers"),
    ("allocator", "maxWatchers"): ("allocator", "max_watchers"),
    ("allocator", "planner"): ("allocator", "planner"),
    ("allocator", "strategyChoice"): ("allocator", "strategy_choice"),
    ("router", "defaultDeadlineMs"): ("router", "default_deadline_ms"),
    ("router", "maxInFlight"): ("router", "max_in_flight"),
    ("router", "reportPeriodSeconds"): ("router", "report_period_s"),
    ("worker", "device"): ("worker", "device"),
    ("worker", "dtype"): ("worker", "dtype"),
    ("worker", "scheduler"): ("worker", "scheduler"),
    ("worker", "maxQueue"): ("worker", "max_queue"),
    ("worker", "maxResidentModels"): ("worker", "max_resident"),
    ("worker", "defaultSize"): ("worker", "default_size"),
    ("worker", "defaultSteps"): ("worker", "default_steps"),
    ("worker", "controlnetMode"): ("worker", "controlnet_mode"),
    ("controlnet", "catalog"): ("controlnet", "catalog"),
    ("controlnet", "device"): ("controlnet", "device"),
    ("controlnet", "dtype"): ("controlnet", "dtype"),
    ("controlnet", "policy"): ("controlnet", "policy"),
    ("controlnet", "maxSessions"): ("controlnet", "max_sessions"),
}


def test_helm_values_default_to_what_the_binaries_default_to() -> None:
    values = yaml.safe_load((ROOT / "helm" / "argus" / "values.yaml").read_text())
    defaults = {command: parser_defaults(command) for command, _ in HELM_FLAGS.values()}
    differ = [
        f"{component}.{key}: {values[component][key]!r}, argus {command} {dest}: "
        f"{defaults[command][dest]!r}"
        for (component, key), (command, dest) in HELM_FLAGS.items()
        if values[component][key] != defaults[command][dest]
    ]
    assert differ == []


def test_helm_values_nested_worker_defaults_match_too() -> None:
    values = yaml.safe_load((ROOT / "helm" / "argus" / "values.yaml").read_text())["worker"]
    worker = parser_defaults("worker")
    assert values["cache"]["maxEntries"] == worker["cache_max_entries"]
    assert values["cache"]["minSimilarity"] == worker["min_similarity"]
    assert values["lora"]["processes"] == worker["lora_processes"]
    assert values["lora"]["bound"] == worker["lora_bound"]


# -- errors name the flag ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("period_s: must be > 0, got 0.0", "--period-s: must be > 0, got 0.0"),
        ("max_watchers: must be >= 1, got 0", "--max-watchers: must be >= 1, got 0"),
        ("tls_cert, tls_key: give both or neither", "tls_cert, tls_key: give both or neither"),
        ("slo_s: not a flag of this command", "slo_s: not a flag of this command"),
        ("no field named here", "no field named here"),
    ],
)
def test_config_errors_name_the_flag(message: str, expected: str) -> None:
    args = argparse.Namespace(period_s=60.0, max_watchers=64, tls_cert=None)
    assert str(config_error(ValueError(message), args)) == expected


def test_the_router_settings_hold_the_service_config_and_copy_none_of_its_fields() -> None:
    """One config per component: the process settings nest the service's config, and a
    field of the service (or of its routing) never appears a second time above it."""
    from dataclasses import fields

    from argus.router.app import RouterSettings
    from argus.router.config import RoutingConfig

    process = {f.name for f in fields(RouterSettings)}
    service = {f.name for f in fields(RouterServiceConfig)}
    routing = {f.name for f in fields(RoutingConfig)}
    assert "service" in process and "routing" in service
    assert process & service == set() and (process | service) & routing == set()


def test_the_allocators_planner_and_strategy_choices_are_the_enums() -> None:
    """The parser offers ``defaults.PLANNERS`` and ``STRATEGY_CHOICES`` without loading the
    solver; they must be the enums' values, the first the control config's default."""
    from argus.allocator.config import StrategyChoice
    from argus.allocator.planner import PlannerMode

    assert tuple(mode.value for mode in PlannerMode) == defaults.PLANNERS
    assert tuple(choice.value for choice in StrategyChoice) == defaults.STRATEGY_CHOICES
    assert ControlConfig().planner == defaults.PLANNERS[0]
    assert ControlConfig().strategy_choice == defaults.STRATEGY_CHOICES[0]
