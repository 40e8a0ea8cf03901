"""``meshsim show torchtitan`` lists every getter kind by its own name, brackets included."""

from __future__ import annotations

from tests.cli.helpers import run_cli
from tests.releases import needs_unflatten


@needs_unflatten
def test_show_prints_bracketed_kind_names_verbatim() -> None:
    """Kind names such as ``dense[tp]`` and ``get_mesh([dp_shard, tp])`` look like rich markup;
    the table must print them as they are, each with its description."""
    result = run_cli("show", "torchtitan", "-n", "8", "--dp-shard", "4", "--tp", "2", "--ep", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("dense[tp]", "get_mesh([dp_shard, tp])", "spmd_meshes()[0][tp]", "world_mesh"):
        row = next((line for line in lines if line.startswith(f"│ {name} ")), None)
        assert row is not None, name
        assert row.split("│")[2].strip(), name  # a description
    assert "get_optional_mesh(pp, include_singleton_axes=True)" in result.stdout
