"""Sweeps: every valid config of a convention for a world size, as parametrizable cases."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, final

from meshsim.model.expected import Expected

if TYPE_CHECKING:
    from meshsim.errors import LayoutError


@lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
    """Divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def above_one(**sizes: int) -> dict[str, int]:
    """The sizes a sweep spells out, in order: a size of 1 is every framework's default, so a
    config leaves it out. ``above_one(pp=1, tp=2)`` is ``{"tp": 2}``."""
    return {key: size for key, size in sizes.items() if size > 1}


def ordered_factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` positive integers whose product is ``n``, lexicographically.

    Example: ``list(ordered_factorizations(4, 2))`` is ``[(1, 4), (2, 2), (4, 1)]``.
    """
    if parts == 1:
        yield (n,)
        return
    for d in divisors(n):
        for rest in ordered_factorizations(n // d, parts - 1):
            yield (d, *rest)


def spread(
    configs: Iterable[Mapping[str, Any]],
    axes: Sequence[str],
    sizes: Callable[[Mapping[str, Any]], Mapping[str, int]] | None = None,
) -> list[dict[str, Any]]:
    """A few of ``configs`` in which each of ``axes``, and each pair of them, is above 1 at
    least once (where any config has it so): the layouts an option is crossed with where
    crossing it with every layout would make the sweep too slow to run live.

    Greedy: each pick adds the most single axes and pairs not yet seen (the earliest config on
    a tie), so the result is the same on every run and keeps the configs' order. ``sizes``
    gives a config's axis sizes where they are not its own keys (a missing key counts as 1).
    Example: of world 8's ``{"tp": 8}``, ``{"dp": 2, "tp": 4}`` and ``{"dp": 8}`` over
    ``("dp", "tp")``, only ``{"dp": 2, "tp": 4}`` is picked.
    """
    listed = [dict(c) for c in configs]
    features = [_features(sizes(c) if sizes else c, axes) for c in listed]
    wanted = set().union(*features) if features else set()
    picked: list[int] = []
    while wanted:
        best = max(range(len(listed)), key=lambda i: (len(features[i] & wanted), -i))
        picked.append(best)
        wanted -= features[best]
    return [listed[i] for i in sorted(picked)]


def _features(sizes: Mapping[str, Any], axes: Sequence[str]) -> set[frozenset[str]]:
    """The axes above 1, one by one and in pairs."""
    above = [a for a in axes if _size(sizes.get(a, 1)) > 1]
    return {frozenset(c) for n in (1, 2) for c in itertools.combinations(above, n)}


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


@dataclass(frozen=True)
class LayoutCase:
    """One framework config at one world size: a pytest parameter with a readable id."""

    framework: str
    world_size: int
    config: dict[str, Any] = field(hash=False)

    @property
    def id(self) -> str:
        parts = [self.framework, str(self.world_size)]
        for key, value in self.config.items():
            # megatron's hyper_comm_grid, torch's explicit mesh tensor: nested values
            if isinstance(value, Mapping) or (
                isinstance(value, (list, tuple))
                and any(isinstance(v, (list, tuple, Mapping)) for v in value)
            ):
                value = _compact(value)
            elif isinstance(value, (list, tuple)):
                value = ",".join(map(str, value)) if value else "-"
            text = str(value).replace(" -> ", ">").replace(" ", ":")
            parts.append(f"{_short(key)}={text}")
        return "-".join(parts)

    def expect(self) -> Expected:
        from meshsim.model.conventions import expect

        return expect(self.framework, self.world_size, **self.config)

    def __str__(self) -> str:
        return self.id


@dataclass(frozen=True)
class RefusedCase(LayoutCase):
    """A config the framework itself rejects: ``error()`` is meshsim's ``LayoutError`` for it,
    whose ``upstream`` names the exception type the framework raises."""

    def error(self) -> LayoutError:
        from meshsim.errors import LayoutError

        try:
            self.expect()
        except LayoutError as exc:
            return exc
        raise AssertionError(f"{self.id}: listed as refused, but the reference builds it")


_SHORT = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "sequence_parallel_size": "sp",
    "mesh_dim_names": "names",
    "mesh_shape": "shape",
}


def _compact(value: Any) -> str:
    """A nested config value without quotes or spaces: ``{shape:[2,4],pgs:[tp,[tp,dp]]}``."""
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_compact(v) for v in value) + "]"
    return str(value)


def _short(key: str) -> str:
    return _SHORT.get(key, key)


def layouts(
    world_size: int,
    framework: str | Sequence[str] | None = None,
    **options: Any,
) -> list[LayoutCase]:
    """Every valid config of one or several conventions (all when ``framework`` is None).

    Options are passed to each convention's ``configs`` (e.g. ``orders=[...]`` for Megatron).
    Each case is checked by building its :class:`Expected`, so invalid configs never appear.
    """
    from meshsim.model.conventions import convention, validate_world_size

    validate_world_size(world_size)
    cases: list[LayoutCase] = []
    for name in _names(framework):
        module = convention(name)
        for config in module.configs(world_size, **options):
            cases.append(LayoutCase(name, world_size, config))
    return cases


def refused_configs(
    world_size: int, framework: str | Sequence[str] | None = None
) -> list[RefusedCase]:
    """Configs each convention's framework rejects at ``world_size``, one per way to fail.

    The other half of :func:`layouts`: a downstream suite parametrizes over both to check that
    its framework builds what meshsim expects *and* refuses what meshsim refuses, with the same
    exception type (``case.error().upstream``).
    """
    from meshsim.model.conventions import convention, validate_world_size

    validate_world_size(world_size)
    cases: list[RefusedCase] = []
    for name in _names(framework):
        for config in convention(name).refused_configs(world_size):
            cases.append(RefusedCase(name, world_size, config))
    return cases


@final
class _Default:
    """The value of a key a case leaves out: the framework's default."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "default"


#: Among :func:`varied_options`' values: cases that leave the key out (the framework's default).
DEFAULT: Final = _Default()


def varied_options(
    framework: str,
    world_size: int,
    cases: Iterable[LayoutCase] | None = None,
    **options: Any,
) -> dict[str, tuple[Any, ...]]:
    """Config key -> the values a sweep gives it, for each key it gives two values or more.

    The sweep is ``cases`` (those of ``framework``), by default ``layouts(world_size,
    framework, **options)``; pass the cases a run keeps (``sweep --real`` drops the lines only
    the reference models) to describe that run. :data:`DEFAULT` stands for the cases that leave
    the key out; values come sorted where they compare, :data:`DEFAULT` first. Keys follow the
    convention's ``PARAMETERS``. Example: ``varied_options("torchtitan", 8)["spmd_backend"]``
    is ``(default, 'full_dtensor', 'partial_dtensor')``.
    """
    from meshsim.model.conventions import convention

    parameters = convention(framework).PARAMETERS
    values = _values(framework, world_size, cases, options)
    return {key: values[key] for key in parameters if len(values[key]) > 1}


def fixed_options(
    framework: str,
    world_size: int,
    cases: Iterable[LayoutCase] | None = None,
    **options: Any,
) -> dict[str, str]:
    """Config key -> why the sweep keeps it at one value: every key :func:`varied_options`
    leaves out, with the convention's reason (``SWEEP_FIXED``: it builds no group, takes one
    value, is a callable, ...) and the one value the sweep gives it.

    Example: ``fixed_options("torchtitan", 8)["ulysses_degree"]`` says it only validates a
    hyper_parallel config (no group depends on it) and that every case leaves it out.
    """
    from meshsim.model.conventions import convention

    module = convention(framework)
    reasons: Mapping[str, str] = getattr(module, "SWEEP_FIXED", {})
    values = _values(framework, world_size, cases, options)
    fixed: dict[str, str] = {}
    for key in module.PARAMETERS:
        if len(values[key]) > 1:
            continue
        (value,) = values[key] or (DEFAULT,)
        held = "every case leaves it out" if value is DEFAULT else f"every case sets {value!r}"
        why = reasons.get(key, f"no valid config at world {world_size} gives it another value")
        fixed[key] = f"{why} ({held})"
    return fixed


def _values(
    framework: str,
    world_size: int,
    cases: Iterable[LayoutCase] | None,
    options: Mapping[str, Any],
) -> dict[str, tuple[Any, ...]]:
    """Config key -> the distinct values ``cases`` give it (DEFAULT where a case leaves it
    out), for every key of the convention."""
    from meshsim.model.conventions import convention

    if cases is None:
        cases = layouts(world_size, framework, **options)
    configs = [c.config for c in cases if c.framework == framework]
    found: dict[str, tuple[Any, ...]] = {}
    for key in convention(framework).PARAMETERS:
        distinct: dict[str, Any] = {}
        for config in configs:
            value = config.get(key, DEFAULT)
            distinct.setdefault(repr(value), value)
        found[key] = _ordered(list(distinct.values()))
    return found


def _ordered(values: list[Any]) -> tuple[Any, ...]:
    """DEFAULT first, then the values sorted where they compare (else as first met)."""
    rest = [v for v in values if v is not DEFAULT]
    with contextlib.suppress(TypeError):  # e.g. megatron's grids: dicts do not compare
        rest = sorted(rest)
    return ((DEFAULT,) if len(rest) < len(values) else ()) + tuple(rest)


def describe_options(
    varied: Mapping[str, tuple[Any, ...]], most: int = 6, width: int = 32
) -> list[str]:
    """One line per varied key for a console: ``spmd_backend: default, full_dtensor,
    partial_dtensor``. Past ``most`` values, the first ones and how many there are; a value
    longer than ``width`` characters is cut (megatron's ``hyper_comm_grid`` takes 24 grids of
    ~200 characters at world 8)."""
    lines = []
    for key, values in varied.items():
        shown = [_cut(_compact(v), width) for v in values]
        if len(shown) > most:
            shown = [*shown[: most - 1], f"... ({len(values)} values)"]
        lines.append(f"{key}: {', '.join(shown)}")
    return lines


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _names(framework: str | Sequence[str] | None) -> Sequence[str]:
    from meshsim.model.conventions import CONVENTIONS

    if framework is None:
        return CONVENTIONS
    return (framework,) if isinstance(framework, str) else framework
