"""torch's private surface: every name meshsim touches exists on the running torch, and no
module but ``meshsim.torch_private`` touches one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import meshsim
from meshsim import torch_private
from meshsim.torch_private import SURFACE

torch = pytest.importorskip("torch")

PACKAGE = Path(meshsim.__file__).parent
VERSION = torch_private.torch_version()


@pytest.mark.parametrize("entry", SURFACE, ids=lambda e: e.name)
def test_each_private_name_is_where_this_torch_release_should_have_it(entry):
    try:
        entry.lookup()
        present = True
    except (AttributeError, ImportError):
        present = False
    assert present == entry.expected(VERSION), (
        f"torch {torch.__version__}: {entry.name} ({entry.use}) is "
        f"{'present' if present else 'missing'}; SURFACE says releases "
        f"{entry.since}..{entry.until or 'now'} have it"
    )


def test_missing_lists_nothing_on_the_running_torch():
    assert torch_private.missing() == [], f"torch {torch.__version__}"


def test_missing_names_an_expected_name_the_release_lacks():
    # A release from the future that should still have every name: the probe must name
    # exactly the entries whose lookup fails, not pass silently.
    absent = [e.name for e in SURFACE if e.until is None and not _present(e)]
    assert torch_private.missing((99, 0)) == absent


def _present(entry: torch_private.Private) -> bool:
    try:
        entry.lookup()
    except (AttributeError, ImportError):
        return False
    return True


# Private torch names, as they would appear in meshsim's source outside the accessor module.
_PRIVATE_USE = re.compile(
    r"(?<!self)\._(world|World|get_default_group|resolve_process_group|new_group_with_tag|"
    r"is_barrier_after_init|get_sequence_number_for_group|flatten|unflatten|get_root_mesh|"
    r"flatten_mapping|mesh_resources|rng_tracker|init_one_process_group|terminate|"
    r"MeshLayout|FlatLayout|clear_sharding_prop_cache|op_dispatcher|get_backend)\b"
    r"|torch\._C\._|_functional_collectives|testing\._internal|_mesh_layout\b|tensor\._"
)


def test_no_module_but_torch_private_touches_a_private_torch_name():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "torch_private.py" or "model" in path.relative_to(PACKAGE).parts:
            continue  # the pure model names torch's terms in prose only (no torch import)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE_USE.search(code) and not _in_prose(code) and "getLogger(" not in code:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert offenders == [], "go through meshsim.torch_private:\n" + "\n".join(offenders)


def _in_prose(code: str) -> bool:
    """Docstrings and messages quote torch's names in double backticks or f-strings."""
    stripped = code.strip()
    return "``" in stripped or stripped.startswith(('"', "'", 'f"', "f'")) or "`_" in stripped


def test_importing_the_accessors_does_not_import_torch():
    probe = "import sys, meshsim.torch_private; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _views() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = torch_private.flatten(mesh["dp", "tp"], "dp_tp")
    return {
        "root": torch_private.root_mesh(mesh["tp"]) is mesh,
        "flattened": {k: v.mesh.tolist() for k, v in torch_private.flatten_mapping(mesh).items()},
        "flat": flat.mesh.tolist(),
    }


def test_root_and_flatten_mapping_read_a_live_mesh():
    result = meshsim.run(_views, world_size=4, backend="threaded", timeout=120)
    assert result[0] == {"root": True, "flattened": {"dp_tp": [0, 1, 2, 3]}, "flat": [0, 1, 2, 3]}


def _split() -> list[list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    split = torch_private.unflatten(world, 0, (2, 2), ("dp", "tp"))
    return [split["dp"].mesh.tolist(), split["tp"].mesh.tolist()]


@pytest.mark.skipif(VERSION < (2, 10), reason=f"torch {torch.__version__} has no _unflatten")
def test_unflatten_splits_a_dim_row_major():
    result = meshsim.run(_split, world_size=4, backend="threaded", timeout=120)
    assert result[3] == [[1, 3], [2, 3]]


@pytest.mark.skipif(VERSION >= (2, 10), reason=f"torch {torch.__version__} has _unflatten")
def test_unflatten_on_a_release_without_it_names_both_versions():
    with pytest.raises(meshsim.RankFailure, match=r"has no .*DeviceMesh\._unflatten.*2\.10"):
        meshsim.run(_split, world_size=4, backend="threaded", timeout=120)


def _emulated() -> dict[str, list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh("cpu", (2, 4), mesh_dim_names=("a", "b"))
    split = torch_private.unflatten(root, "b", (2, 2), ("b1", "b2"), emulate=True)
    flat = torch_private.flatten(root, "ab")
    again = torch_private.unflatten(flat, 0, (4, 2), ("x", "y"), emulate=True)
    views = {name: split[name] for name in ("a", "b1", "b2")}
    views |= {name: again[name] for name in ("x", "y")}
    return {name: sorted(view.mesh.flatten().tolist()) for name, view in views.items()}


def test_unflatten_for_a_framework_that_never_calls_it_works_on_every_release():
    # meshsim's Megatron/DeepSpeed builders split dims with _unflatten; on torch < 2.10 the
    # same groups come from a DeviceMesh built over the world (nothing to skip there).
    result = meshsim.run(_emulated, world_size=8, backend="threaded", timeout=120)
    for rank, groups in enumerate(result):
        a, b1, b2 = rank // 4, rank % 4 // 2, rank % 2
        assert groups == {
            "a": [b1 * 2 + b2, 4 + b1 * 2 + b2],
            "b1": [a * 4 + b2, a * 4 + 2 + b2],
            "b2": [a * 4 + b1 * 2, a * 4 + b1 * 2 + 1],
            "x": [rank % 2 + 2 * i for i in range(4)],
            "y": [rank // 2 * 2, rank // 2 * 2 + 1],
        }, f"rank {rank}"


def test_below_the_floor_every_run_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch_private, "torch_version", lambda: (2, 6))
    with pytest.raises(torch_private.TorchTooOld) as e:
        meshsim.run(_views, world_size=4, backend="threaded", timeout=120)
    assert str(e.value) == (
        "meshsim needs torch >= 2.9, found torch 2.6; install a newer torch "
        "(meshsim is tested on 2.9.1 to 2.15.0)"
    )


def test_the_floor_matches_pyproject():
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    floor = ".".join(map(str, torch_private.SUPPORTED_SINCE))
    assert f'"torch>={floor}",' in text
