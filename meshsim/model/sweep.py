"""Sweeps: every valid config of a convention for a world size, as parametrizable cases."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from meshsim.model.expected import Expected


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
    from meshsim.model.conventions import CONVENTIONS, convention, validate_world_size

    validate_world_size(world_size)
    names: Iterable[str]
    if framework is None:
        names = CONVENTIONS
    elif isinstance(framework, str):
        names = (framework,)
    else:
        names = framework
    cases: list[LayoutCase] = []
    for name in names:
        module = convention(name)
        for config in module.configs(world_size, **options):
            cases.append(LayoutCase(name, world_size, config))
    return cases
