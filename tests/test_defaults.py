"""Each default is written once: a command's flags, the process settings they fill, the
configs those build, ``argus up``'s cluster spec and the Helm chart's values all agree.

The flags' defaults are read from the real parsers (``argus.cli.main`` builds them the same
way), with no ``--help``: whatever a flag defaults to must be what the settings field it maps
to defaults to, so a default changed in one place and not the other fails here.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from argus.allocator.app import AllocatorSettings
from argus.allocator.control import ControlConfig
from argus.cli.main import COMMANDS, OneLineParser, config_error, load_command
from argus.local_cluster import ClusterSpec
from argus.router.app import RouterSettings
from argus.router.core import RouterServiceConfig

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


def test_allocator_flags_default_to_the_settings_and_the_settings_to_the_control() -> None:
    flags = parser_defaults("allocator")
    settings = AllocatorSettings()
    assert mismatches(flags, field_defaults(settings)) == []
    assert {"period_s", "heartbeat_s", "max_watchers", "retrieval_window_s"} <= set(flags)
    assert settings.control_config() == ControlConfig()  # nothing the control defaults differently


def test_router_flags_default_to_the_settings_and_the_settings_to_the_service() -> None:
    flags = parser_defaults("router")
    settings = RouterSettings(allocator=ALLOCATOR)
    assert mismatches(flags, field_defaults(settings), own=frozenset({"allocator"})) == []
    assert {"report_period_s", "default_deadline_ms", "max_in_flight"} <= set(flags)
    assert settings.service_config() == RouterServiceConfig()


def test_router_drift_flags_default_to_the_drift_configs() -> None:
    from argus.cli.router import drift_settings
    from argus.router.drift import DriftSettings

    parser = OneLineParser(prog="argus router")
    load_command("router").add_arguments(parser)
    args = parser.parse_args(["--allocator", ALLOCATOR])
    assert drift_settings(args) == DriftSettings()  # window, tolerance, retrain, min labels


def test_worker_flags_default_to_the_settings_and_the_settings_to_the_engine() -> None:
    from argus.worker.adapters import AdapterSettings
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
    from argus.worker.controlnet.app import ControlNetSettings

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
    allocator = AllocatorSettings()
    for name in ("period_s", "heartbeat_s", "retrieval_threshold_s", "retrieval_window_s"):
        assert getattr(spec, name) == getattr(allocator, name), name
    from argus.worker.app import WorkerSettings

    assert spec.default_size == WorkerSettings().default_size
    from argus.supervision import RestartPolicy

    assert flags["max_restarts"] == RestartPolicy().max_deaths


def test_argus_plan_plans_for_the_allocators_period() -> None:
    from argus.allocator.planner import PlannerConfig

    assert parser_defaults("plan")["period"] == PlannerConfig().period_s == ControlConfig().period_s


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
    ("router", "defaultDeadlineMs"): ("router", "default_deadline_ms"),
    ("router", "maxInFlight"): ("router", "max_in_flight"),
    ("router", "reportPeriodSeconds"): ("router", "report_period_s"),
    ("worker", "device"): ("worker", "device"),
    ("worker", "dtype"): ("worker", "dtype"),
    ("worker", "scheduler"): ("worker", "scheduler"),
    ("worker", "maxQueue"): ("worker", "max_queue"),
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
