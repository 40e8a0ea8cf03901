"""The fake tier's fast path for DeviceMesh groups that the running rank is not a member of.

On CPU, torch's ``DeviceMesh`` creates every group of every mesh dim on every rank with one
``new_group`` call per group: 328 calls per rank for an 8x8x16 mesh, 335,872 at world 1,024,
of which all but one per dim are for groups the rank is not in. For a non-member, torch's
``new_group`` only validates the ranks, takes the next group name (``_world.group_count``),
and leaves the last non-member group's rank mapping under ``GroupMember.NON_GROUP_MEMBER`` in
``_world.pg_group_ranks``. This module reproduces exactly those side effects for the
non-member rows of a dim in one step, records each of those creations for the divergence
check as the recorder would (same ``Call``, same order), and makes the rank's own group with
torch's real ``new_group``. The rows, their ``Call`` records and rank mappings are computed once
per (layout, rank map, dim) and shared by every rank of the run.

Anything outside the plain case (a backend override, an accelerator ``split_group`` path,
TorchComms, ``TORCH_DIST_INIT_BARRIER=1``, a monkeypatched ``new_group``, invalid or
overlapping rows, a group-name clash) goes through torch's own code unchanged.
``MESHSIM_FAKE_FASTPATH=0`` turns the fast path off.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

from meshsim import torch_private
from meshsim.harness import recorder
from meshsim.harness.sites import call_site

#: Use the fast path in the fake tier (env ``MESHSIM_FAKE_FASTPATH=0`` turns it off).
ENABLED = os.environ.get("MESHSIM_FAKE_FASTPATH", "1") != "0"


@dataclass(frozen=True)
class _Plan:
    """One mesh dim's groups, the same for every rank of the run."""

    rows: tuple[tuple[int, ...], ...]  # each group's global ranks, sorted (as torch sorts them)
    calls: tuple[recorder.Call, ...]  # what the recorder logs for each row's ``new_group``
    row_of: dict[int, int]  # global rank -> index of the one row holding it


class NonMemberFastPath:
    """Replaces ``DeviceMesh._init_one_process_group`` for the duration of one fake run."""

    def __init__(self) -> None:
        self._plans: dict[tuple, _Plan | None] = {}
        #: (plan, user's line) -> the plan's records naming that line, made once per run.
        self._sited: dict[tuple[int, object], tuple[recorder.Call, ...]] = {}
        self.installed = False
        self._original: Any = None
        self._new_group: Any = None
        self._new_group_with_tag: Any = None

    # ------------------------------------------------------------------ install

    def install(self) -> None:
        """Patch DeviceMesh (after ``recorder.install``, so its wrappers are what we expect)."""
        import torch.distributed.device_mesh as dm

        if not ENABLED or self.installed or not hasattr(dm, "DeviceMesh"):
            return
        original = torch_private.mesh_group_factory()
        if not isinstance(original, staticmethod):
            return  # another torch: keep torch's code
        self._original = original
        self._new_group = getattr(dm, "new_group", None)
        self._new_group_with_tag = torch_private.new_group_with_tag()
        fast = self._init_one_process_group
        torch_private.set_mesh_group_factory(staticmethod(fast))
        self.installed = True

    def uninstall(self) -> None:
        """Put torch's method back and forget the run's plans."""

        if self.installed:
            torch_private.set_mesh_group_factory(self._original)
            self.installed = False
        self._plans.clear()
        self._sited.clear()

    # ------------------------------------------------------------------ the replacement

    def _init_one_process_group(
        self, sub_layout: Any, rank_map: Any, dim_name: str, backend_override: Any, *extra: Any
    ) -> Any:
        """torch's method, with the non-member rows of the dim done in one step."""
        original = self._original.__func__
        if any(extra) or not self._applies(sub_layout, backend_override):
            return original(sub_layout, rank_map, dim_name, backend_override, *extra)
        plan = self._plan(sub_layout, rank_map, dim_name)
        default = torch_private.default_group()
        hit = plan.row_of.get(default.rank()) if plan is not None else None
        if plan is None or hit is None or default.size() <= max(plan.row_of):
            return original(sub_layout, rank_map, dim_name, backend_override, *extra)
        world = torch_private.world()
        first = world.group_count
        if _name_clash(world, first, len(plan.rows)):
            return original(sub_layout, rank_map, dim_name, backend_override, *extra)
        self._skip_rows(plan, 0, hit)
        group = self._new_group(ranks=list(plan.rows[hit]), group_desc=f"mesh_{dim_name}")
        self._skip_rows(plan, hit + 1, len(plan.rows))
        return group.group_name

    def _applies(self, sub_layout: Any, backend_override: Any) -> bool:
        """The plain CPU case, where torch loops over ``new_group`` for every row."""
        import torch.distributed as dist
        import torch.distributed.device_mesh as dm

        if backend_override != (None, None) or not dist.is_initialized():
            return False
        if dm.new_group is not self._new_group:
            return False  # the body patched DeviceMesh's new_group: let it see every call
        if torch_private.new_group_with_tag() is not self._new_group_with_tag:
            return False  # likewise for torch's own entry point
        default = torch_private.default_group()
        if sub_layout.numel() == default.size():
            return False  # torch's early return (the world group)
        if getattr(default, "bound_device_id", None) is not None:
            return False
        if _torchcomms() or torch_private.barrier_after_init():
            return False
        return str(torch_private.world().pg_map[default][0]) == "fake"

    def _plan(self, sub_layout: Any, rank_map: Any, dim_name: str) -> _Plan | None:
        """The dim's rows and records, cached for the run; ``None`` when torch must decide."""
        key = (sub_layout, dim_name, str(rank_map.dtype), rank_map.numpy().tobytes())
        if key not in self._plans:
            self._plans[key] = _make_plan(sub_layout, rank_map, dim_name)
        return self._plans[key]

    def _calls_at(self, plan: _Plan, site: object) -> tuple[recorder.Call, ...]:
        """The plan's records as the recorder would make them from the user's line ``site``."""
        if site is None:
            return plan.calls
        key = (id(plan), site)
        if key not in self._sited:
            self._sited[key] = tuple(dataclasses.replace(c, site=site) for c in plan.calls)
        return self._sited[key]

    def _skip_rows(self, plan: _Plan, start: int, stop: int) -> None:
        """What torch's ``new_group`` does for non-member rows ``start:stop``, in one step."""
        import torch.distributed.distributed_c10d as c10d

        if start >= stop:
            return
        sink = recorder._current_sink()
        if sink is not None and not getattr(recorder._tls, "depth", False):
            calls = self._calls_at(plan, call_site(sys._getframe(1)))[start:stop]
            created = getattr(sink, "created", None)  # TrackingSink's bulk form
            if created is not None:
                created(calls)
            else:
                for call in calls:
                    sink.enter(call)
                    sink.exit(call)
        world = torch_private.world()
        world.group_count += stop - start
        last = plan.rows[stop - 1]
        world.pg_group_ranks[c10d.GroupMember.NON_GROUP_MEMBER] = {r: i for i, r in enumerate(last)}


def _make_plan(sub_layout: Any, rank_map: Any, dim_name: str) -> _Plan | None:
    """Rows of the dim as torch computes them; ``None`` unless every rank is in one valid row."""
    axis = torch_private.mesh_layout_axis(sub_layout)
    # One row per group: torch 2.10-2.12 give a flattened dim's groups one tensor dim per mode.
    table = axis.remap_to_tensor(rank_map)
    rows = tuple(tuple(sorted(row)) for row in table.reshape(table.shape[0], -1).tolist())
    row_of: dict[int, int] = {}
    for index, row in enumerate(rows):
        if len(set(row)) != len(row) or (row and row[0] < 0):
            return None  # torch raises ValueError: let it
        for rank in row:
            if row_of.setdefault(rank, index) != index:
                return None  # a rank in two rows: torch raises RuntimeError
    desc = f"mesh_{dim_name}"
    calls = tuple(
        recorder._describe_creation(
            "new_group", {"ranks": row, "group_desc": desc, "use_local_synchronization": False}
        )
        for row in rows
    )
    return _Plan(rows, calls, row_of)


def _name_clash(world: Any, first: int, count: int) -> bool:
    """A name torch would hand out in ``first .. first+count-1`` is taken (torch raises)."""
    names = world.pg_names.values()
    return any(name.isdigit() and first <= int(name) < first + count for name in names)


def _torchcomms() -> bool:
    """TorchComms routes ``new_group`` through ``split_group`` (not the path reproduced)."""
    try:
        import torch.distributed.config as dist_config
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(getattr(dist_config, "use_torchcomms", False))
