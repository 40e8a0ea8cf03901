"""Sweeps: every valid config of a convention for a world size, as parametrizable cases."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

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
            if isinstance(value, Mapping):  # e.g. megatron's hyper_comm_grid
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


def _names(framework: str | Sequence[str] | None) -> Sequence[str]:
    from meshsim.model.conventions import CONVENTIONS

    if framework is None:
        return CONVENTIONS
    return (framework,) if isinstance(framework, str) else framework
