"""Run a builder on every rank of a fake world, one rank after another, without the harness."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshsim.builders import build
from meshsim.checks import Observation
from tests.fake_rank import as_fake_rank


def build_every_rank(framework: str, world: int, config: Mapping[str, Any]) -> list[Observation]:
    """Each rank's Observation: the fake backend builds real meshes, metadata only."""
    out = []
    for rank in range(world):
        with as_fake_rank(rank, world):
            out.append(build(framework, world, config))
    return out


def on_rank(framework: str, world: int, config: Mapping[str, Any], rank: int) -> Observation:
    """One rank's Observation (cheap: the other ranks are not built)."""
    with as_fake_rank(rank, world):
        return build(framework, world, config)


def release_refusal(framework: str, world: int, config: Mapping[str, Any]) -> Exception | None:
    """The reference's refusal of a config only the installed torch release refuses.

    The reference follows the installed release (e.g. torch 2.9 has no ``_unflatten``): None
    when it accepts the config, or when every release refuses it.
    """
    import os

    from meshsim import LayoutError, expect

    try:
        expect(framework, world, **config)
        return None
    except LayoutError as refusal:
        pinned = os.environ.get("MESHSIM_TORCH_RELEASE")
        os.environ["MESHSIM_TORCH_RELEASE"] = "newest"
        try:
            expect(framework, world, **config)
        except LayoutError:
            return None
        finally:
            if pinned is None:
                del os.environ["MESHSIM_TORCH_RELEASE"]
            else:
                os.environ["MESHSIM_TORCH_RELEASE"] = pinned
        return refusal


def refused_by_this_release(framework: str, world: int, config: Mapping[str, Any]) -> str | None:
    """Why the installed torch refuses a config newer releases build, once the builder is
    seen refusing it alike on every rank; None when the release does not refuse it."""
    refusal = release_refusal(framework, world, config)
    if refusal is None:
        return None
    try:
        build_every_rank(framework, world, config)
    except Exception as built:  # the release's own error, or meshsim's TorchTooOld
        raised = getattr(built, "upstream", None) or type(built).__name__
        assert raised == getattr(refusal, "upstream", None), (str(refusal), str(built))
    else:
        raise AssertionError(f"the reference refuses ({refusal}) but the builder built it")
    import torch

    return f"torch {torch.__version__}: {refusal} (the builder refuses alike)"
