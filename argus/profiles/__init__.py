"""Load and validate profile sets (levels and their per-GPU numbers) from TOML or YAML.

A profile file has ``worker_classes`` (list of GPU type names) and ``levels``, a list of tables
with ``name``, ``strategy`` (AC or SM), ``model``, ``skip_steps`` (AC only), ``quality`` and
``profiles.<class>`` holding ``latency_s``, ``load_time_s``, ``gpu_memory_gib`` and optionally
``throughput_qpm`` (default 60 / latency_s: batch size 1). Levels of each strategy are listed
slowest first; see ``default.toml`` for the shipped set and its sources. An optional
``reference`` table (``width``, ``height``, ``steps``) says what request the latencies were
measured on (default 1024 × 1024, 50 steps); the router prices requests relative to it.
An optional ``models`` table gives a model's parts (``models.<model>.parts.<part> = { id,
share }``): ``id`` names the weights (two models listing one id share that part, so a worker
holding one loads only the other's remaining parts) and ``share`` the part's fraction of the
model's load time and memory; a model's shares sum to 1. A model without parts loads whole.
``models.<model>.cache`` holds the approximate cache's similarity → K rule for that model
(``floors = { 5 = 0.65, … }``, :mod:`argus.profiles.cache_evidence`), read by
:func:`load_cache_rules`.

Every error is a :class:`ProfileError` whose message starts with the path of the bad field,
for example ``levels[3].profiles.a100.throughput_qpm: must be > 0, got -1``.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from argus.profiles.cache_evidence import KRule
from argus.types import (
    Level,
    LevelProfile,
    ModelPart,
    ProfileSet,
    ReferenceRequest,
    Strategy,
)

DEFAULT_PROFILE_PATH = Path(__file__).with_name("default.toml")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the field."""


MONOLITHIC_SUFFIX = ":monolithic"
"""Appended to a profile source (``default:monolithic``): the same profiles with every model
loaded whole, no part shared (:meth:`ProfileSet.monolithic`), to compare against."""


def load_profiles(source: str | Path) -> ProfileSet:
    """Load ``default`` or a ``.toml``/``.yaml``/``.yml`` file, either followed by
    ``:monolithic`` for its models loaded whole; raise ProfileError if invalid."""
    text = str(source)
    if text.endswith(MONOLITHIC_SUFFIX):
        whole = load_profiles(text.removesuffix(MONOLITHIC_SUFFIX)).monolithic()
        return replace(whole, source=text)
    if text == "default":
        return parse_profiles(_read(DEFAULT_PROFILE_PATH), source="default")
    return parse_profiles(_read(Path(source)), source=text)


def default_profiles() -> ProfileSet:
    return load_profiles("default")


def _read(path: Path) -> Any:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile file: {exc.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            return yaml.safe_load(text)
        if path.suffix == ".toml":
            return tomllib.loads(text.decode("utf-8"))
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    raise ProfileError(f"{path}: unknown profile format {path.suffix!r}: use .toml or .yaml")


def parse_profiles(data: Any, source: str = "<memory>") -> ProfileSet:
    """Validate an already-parsed document (a mapping) into a ProfileSet."""
    root = _mapping(data, "profile")
    classes = _worker_classes(root.get("worker_classes"))
    raw_levels = root.get("levels")
    if not isinstance(raw_levels, list) or not raw_levels:
        raise ProfileError("levels: must be a non-empty list of levels")
    levels: list[Level] = []
    table: dict[tuple[str, str], LevelProfile] = {}
    for index, raw in enumerate(raw_levels):
        where = f"levels[{index}]"
        level = _level(_mapping(raw, where), where)
        if any(existing.name == level.name for existing in levels):
            raise ProfileError(f"{where}.name: duplicate level name {level.name!r}")
        levels.append(level)
        table.update(_class_profiles(_mapping(raw, where).get("profiles"), classes, level, where))
    _check_speed_order(levels, classes, table)
    parts = _model_parts(root.get("models"), {level.model for level in levels})
    return ProfileSet(
        tuple(levels), classes, table, source, _reference(root.get("reference")), parts
    )


SHARE_TOLERANCE = 1e-3  # a model's part shares must sum to 1 within this


def _model_parts(value: Any, models: set[str]) -> dict[str, tuple[ModelPart, ...]]:
    if value is None:
        return {}
    out = {}
    for model, raw in _mapping(value, "models").items():
        where = f"models.{model}"
        if model not in models:
            raise ProfileError(f"{where}: {model!r} is not the model of any level")
        entry = _mapping(raw, where)
        if "cache" in entry:
            _cache_rule(entry["cache"], f"{where}.cache")  # checked here, read by load_cache_rules
            if "parts" not in entry:
                continue
        raw_parts = _mapping(entry.get("parts"), f"{where}.parts")
        if not raw_parts:
            raise ProfileError(f"{where}.parts: must name at least one part")
        parts = []
        for name, entry in raw_parts.items():
            at = f"{where}.parts.{name}"
            table = _mapping(entry, at)
            share = _number(table, "share", at)
            if not 0.0 < share <= 1.0:
                raise ProfileError(f"{at}.share: must be in (0, 1], got {share}")
            parts.append(ModelPart(name, _string(table, "id", at), share))
        total = sum(part.share for part in parts)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise ProfileError(f"{where}.parts: the shares must sum to 1, got {total:.4f}")
        out[model] = tuple(parts)
    return out


def load_cache_rules(source: str | Path) -> dict[str, KRule]:
    """The approximate-cache rule of each model whose profile has a ``[models.X.cache]``
    table (:class:`~argus.profiles.cache_evidence.KRule`), from the same sources as
    :func:`load_profiles`; a model without one uses
    :data:`~argus.profiles.cache_evidence.DEFAULT_RULE`. Raises ProfileError."""
    text = str(source).removesuffix(MONOLITHIC_SUFFIX)
    path = DEFAULT_PROFILE_PATH if text == "default" else Path(text)
    models = _mapping(_read(path), "profile").get("models") or {}
    return {
        str(model): _cache_rule(entry["cache"], f"models.{model}.cache")
        for model, entry in _mapping(models, "models").items()
        if isinstance(entry, Mapping) and "cache" in entry
    }


def _cache_rule(value: Any, where: str) -> KRule:
    try:
        return KRule.from_section(_mapping(value, where), where)
    except ValueError as exc:
        raise ProfileError(str(exc)) from None


def _reference(value: Any) -> ReferenceRequest:
    if value is None:
        return ReferenceRequest()
    raw = _mapping(value, "reference")
    sizes = {}
    for key in ("width", "height", "steps"):
        number = raw.get(key, getattr(ReferenceRequest, key))
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise ProfileError(f"reference.{key}: must be an integer >= 1, got {number!r}")
        sizes[key] = number
    return ReferenceRequest(**sizes)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: must be a table/mapping, got {type(value).__name__}")
    return value


def _worker_classes(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ProfileError("worker_classes: must be a non-empty list of GPU type names")
    for index, name in enumerate(value):
        if not isinstance(name, str) or not name:
            raise ProfileError(f"worker_classes[{index}]: must be a non-empty string, got {name!r}")
    if len(set(value)) != len(value):
        raise ProfileError(f"worker_classes: duplicate names in {value!r}")
    return tuple(value)


def _level(raw: Mapping[str, Any], where: str) -> Level:
    name = _string(raw, "name", where)
    try:
        strategy = Strategy.parse(_string(raw, "strategy", where))
    except ValueError as exc:
        raise ProfileError(f"{where}.strategy: {exc}") from None
    skip_steps = raw.get("skip_steps", 0)
    if not isinstance(skip_steps, int) or isinstance(skip_steps, bool) or skip_steps < 0:
        raise ProfileError(f"{where}.skip_steps: must be an integer >= 0, got {skip_steps!r}")
    if strategy is Strategy.SM and skip_steps != 0:
        raise ProfileError(f"{where}.skip_steps: SM levels do not skip steps, got {skip_steps}")
    quality = _number(raw, "quality", where)
    if not 0.0 < quality <= 1.0:
        raise ProfileError(f"{where}.quality: must be in (0, 1], got {quality}")
    return Level(name, strategy, _string(raw, "model", where), skip_steps, quality)


def _class_profiles(
    value: Any, classes: tuple[str, ...], level: Level, where: str
) -> dict[tuple[str, str], LevelProfile]:
    profiles = _mapping(value, f"{where}.profiles")
    unknown = sorted(set(profiles) - set(classes))
    if unknown:
        raise ProfileError(f"{where}.profiles.{unknown[0]}: unknown worker class {unknown[0]!r}")
    out = {}
    for worker_class in classes:
        if worker_class not in profiles:
            raise ProfileError(f"{where}.profiles.{worker_class}: missing for level {level.name!r}")
        field_where = f"{where}.profiles.{worker_class}"
        out[(worker_class, level.name)] = _level_profile(
            _mapping(profiles[worker_class], field_where), field_where
        )
    return out


def _level_profile(raw: Mapping[str, Any], where: str) -> LevelProfile:
    latency = _number(raw, "latency_s", where)
    if latency <= 0.0:
        raise ProfileError(f"{where}.latency_s: must be > 0, got {latency}")
    throughput = _number(raw, "throughput_qpm", where, default=60.0 / latency)
    if throughput <= 0.0:
        raise ProfileError(f"{where}.throughput_qpm: must be > 0, got {throughput}")
    load_time = _number(raw, "load_time_s", where)
    if load_time < 0.0:
        raise ProfileError(f"{where}.load_time_s: must be >= 0, got {load_time}")
    memory = _number(raw, "gpu_memory_gib", where)
    if memory < 0.0:
        raise ProfileError(f"{where}.gpu_memory_gib: must be >= 0, got {memory}")
    return LevelProfile(latency, throughput, load_time, memory)


def _check_speed_order(
    levels: list[Level], classes: tuple[str, ...], table: Mapping[tuple[str, str], LevelProfile]
) -> None:
    """Within a strategy, throughput must not fall from one level to the next on any class."""
    for strategy in Strategy:
        ordered = [level for level in levels if level.strategy is strategy]
        for slower, faster in itertools.pairwise(ordered):
            for worker_class in classes:
                slow = table[(worker_class, slower.name)].throughput_qpm
                fast = table[(worker_class, faster.name)].throughput_qpm
                if fast < slow:
                    index = levels.index(faster)
                    raise ProfileError(
                        f"levels[{index}].profiles.{worker_class}.throughput_qpm: levels must be "
                        f"listed slowest first, but {faster.name!r} ({fast:.3g} QPM) is slower "
                        f"than {slower.name!r} ({slow:.3g} QPM) before it"
                    )


def _string(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ProfileError(f"{where}.{key}: must be a non-empty string, got {value!r}")
    return value


def _number(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"{where}.{key}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ProfileError(f"{where}.{key}: must be finite, got {value}")
    return float(value)
