"""``meshsim show torchtitan`` lists every getter kind by its own name, brackets included."""

from __future__ import annotations

from tests.cli.helpers import run_cli
from tests.releases import needs_unflatten


@needs_unflatten
def test_show_prints_bracketed_kind_names_verbatim() -> None:
    """Kind names such as ``dense[tp]`` and ``get_mesh([dp_shard, tp])`` look like rich markup;
    the table must print them as they are, each with its description."""
    result = run_cli(
        "show", "torchtitan", "-n", "8", "--dp-shard", "4", "--tp", "2", "--ep", "2", "--all-kinds"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("dense[tp]", "get_mesh([dp_shard, tp])", "spmd_meshes()[0][tp]", "world_mesh"):
        row = next((line for line in lines if line.startswith(f"│ {name} ")), None)
        assert row is not None, name
        assert row.split("│")[2].strip(), name  # a description
    assert "get_optional_mesh(pp, include_singleton_axes=True)" in result.stdout


@needs_unflatten
def test_show_defaults_to_the_axes_views_and_roles() -> None:
    """torchtitan hands out ~230 getter kinds; by default show lists the world mesh, the axes,
    the view getters and the kinds of roles (was: 4,864 lines at world 8), and says what more
    there is."""
    result = run_cli("show", "torchtitan", "-n", "8", "--tp", "2", "--no-grid")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert len(out.splitlines()) < 60
    for name in ("tp", "batch", "loss", "world_mesh", "spmd_dense_mesh()"):
        assert any(line.startswith(f"│ {name} ") for line in out.splitlines()), name
    assert "dense[tp]" not in out and "include_singleton_axes" not in out
    assert "more kinds" in out and "--all-kinds lists them" in out


@needs_unflatten
def test_kinds_filters_the_unavailable_lines_too() -> None:
    result = run_cli("show", "torchtitan", "-n", "8", "--tp", "2", "--kinds", "tp,pp", "--no-grid")
    assert result.returncode == 0, result.stderr
    unavailable = result.stdout.split("unavailable")[1].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in unavailable if line.startswith("  ")] == ["pp"]
