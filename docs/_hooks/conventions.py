"""Generates the tables of each convention page from the code, so they cannot go stale."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

#: One representative config per convention, at world 8: the groups a reader sees first.
#: A key missing here fails the docs build (and tests/docs), so a new convention gets one.
REPRESENTATIVE: dict[str, dict[str, Any]] = {
    "torch": {
        "mesh_shape": (2, 2, 2),
        "mesh_dim_names": ("dp", "cp", "tp"),
        "ops": ["flatten dp,cp"],
    },
    "olmo-core": {"dp": "hsdp", "num_replicas": 2, "cp": 2},
    "torchtitan": {"dp_shard": 2, "cp": 2, "tp": 2},
    "megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "megatron-deepspeed": {"sequence_parallel_size": 2},
    "deepspeed": {"num_pp": 2, "num_mp": 2, "num_dp": 2},
    "deepspeed-autoep": {"ep_size": 2},
    "accelerate": {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
    "transformers": {"tp_size": 2, "fsdp_size": 4},
    "lightning": {"data_parallel_size": 4, "tensor_parallel_size": 2},
    "verl": {"strategy": "fsdp2", "fsdp_size": 4},
    "areal": {"num_pp": 2, "num_dp": 2, "num_tp": 2},
    "areal-fsdp": {"data_parallel_size": 4, "tensor_parallel_size": 2},
    "areal-archon": {"dp_shard": 2, "cp": 2, "tp": 2},
}
WORLD = 8
#: Refused configs shown per page; the rest are counted.
MAX_REFUSALS = 12
_MARKER = re.compile(r"<!--\s*generated:\s*convention\s+(\S+)\s*-->")


#: Characters Markdown would read as syntax in a table cell's text: emphasis (``*fsdp*``,
#: ``_get_x('ep_size_<n>')``), links, the cell separator, a lone backtick, and the braces
#: attr_list takes as the cell's attributes (a trailing ``{'tensor': 'tp'}`` vanished into
#: them). Each is backslash-escaped; ``<`` and ``&`` become entities.
_MARKDOWN_SYNTAX = re.compile(r"([\\`*_{}\[\]|])")
#: A code span the text already has (upstream messages quote names in backticks): kept.
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")


def _cell(text: object) -> str:
    """``text`` as literal table-cell text on one line: its code spans stay code, and
    everything else that Markdown would read as syntax is escaped."""
    one_line = " ".join(str(text).splitlines())
    parts, start = [], 0
    for span in _CODE_SPAN.finditer(one_line):
        parts += [_literal(one_line[start : span.start()]), span.group(0)]
        start = span.end()
    return "".join([*parts, _literal(one_line[start:])])


def _literal(text: str) -> str:
    escaped = _MARKDOWN_SYNTAX.sub(r"\\\1", text)
    return escaped.replace("&", "&amp;").replace("<", "&lt;")


def _code(text: object) -> str:
    """``text`` as a code span in a table cell (backslashes are literal there; the table
    extension keeps a ``|`` inside backticks in its cell)."""
    one_line = " ".join(str(text).splitlines())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", one_line)), default=0) + 1)
    pad = " " if one_line.startswith("`") or one_line.endswith("`") else ""
    return f"{fence}{pad}{one_line}{pad}{fence}"


def _config(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in config.items())


def _first_groups(groups: Iterable[tuple[int, ...]], shown: int = 3) -> str:
    groups = list(groups)
    text = ", ".join(str(tuple(g)) for g in groups[:shown])
    more = len(groups) - shown
    return text + (f", ... {more} more" if more > 0 else "")


def parameters_table(framework: str) -> str:
    from meshsim.model.conventions import convention

    rows = ["| config key | what it is (the framework's own call) |", "|---|---|"]
    for key, description in convention(framework).PARAMETERS.items():
        rows.append(f"| {_code(key)} | {_cell(description)} |")
    return "\n".join(rows)


def kinds_table(framework: str) -> str:
    import meshsim

    config = REPRESENTATIVE[framework]
    exp = meshsim.expect(framework, WORLD, **config)
    roles_of: dict[str, list[str]] = {}
    for role, kind in exp.roles.items():
        roles_of.setdefault(kind, []).append(role)
    available = exp.kinds()
    unavailable = exp.unavailable()
    primary = exp.primary_kinds()
    lines = [
        f"`meshsim.expect({framework!r}, {WORLD}, {_config(config)})`"
        f" (`meshsim show {framework} -n {WORLD} ...` prints the same):",
        "",
        "| kind | upstream call | groups | first groups | role |",
        "|---|---|--:|---|---|",
    ]
    for name in primary:
        role = _cell(", ".join(roles_of.get(name, [])))
        if name in available:
            groups = exp.groups(name)
            lines.append(
                f"| {_code(name)} | {_cell(available[name])} | {len(groups)} "
                f"| {_cell(_first_groups(groups))} | {role} |"
            )
        else:
            error = unavailable[name]
            lines.append(f"| {_code(name)} | unavailable: {_cell(error)} | 0 | | {role} |")
    hidden = len(available) + len(unavailable) - len(primary)
    if hidden > 0:
        lines += [
            "",
            f"Plus {hidden} more kinds (each getter call and view dim): "
            f"`meshsim show {framework} --all-kinds` lists them.",
        ]
    lines += [
        "",
        "Roles under this config: "
        + ", ".join(f"`{role}` → `{kind}`" for role, kind in exp.roles.items())
        + ".",
    ]
    return "\n".join(lines)


def refusals_table(framework: str) -> str:
    import meshsim

    cases = meshsim.refused_configs(WORLD, framework)
    configs = [case.config for case in cases]
    lines = [
        f"`meshsim.refused_configs({WORLD}, {framework!r})`: {len(configs)} configs the "
        "framework itself rejects; "
        "the reference raises `meshsim.LayoutError` naming upstream's exception.",
        "",
        "| config | refusal |",
        "|---|---|",
    ]
    for config in configs[:MAX_REFUSALS]:
        try:
            meshsim.expect(framework, WORLD, **config)
        except meshsim.LayoutError as err:
            message = str(err).splitlines()[0]
        else:  # a listed refusal the reference accepts: make the build fail, loudly
            raise RuntimeError(f"{framework}: refused config {config} is accepted")
        if len(message) > 160:
            message = message[:157] + "..."
        lines.append(f"| {_code(_config(config))} | {_cell(message)} |")
    if len(configs) > MAX_REFUSALS:
        lines.append(f"| ... {len(configs) - MAX_REFUSALS} more | |")
    return "\n".join(lines)


def role_families_table(framework: str) -> str | None:
    """The naming families a convention reads roles from (its ``ROLE_FAMILIES``: the torch
    convention's), each with the roles ``meshsim.expect`` gives its example; None without."""
    import meshsim
    from meshsim.model.conventions import convention

    families = getattr(convention(framework), "ROLE_FAMILIES", None)
    if families is None:
        return None
    lines = [
        f"What `meshsim.expect({framework!r}, {WORLD}, ...)` reads off the dim names of each "
        "family's example (`×`: a product of dims the mesh never flattened, a kind of its own):",
        "",
        "| family | who names dims so | example | `data_parallel` | `gradient_reduce` |",
        "|---|---|---|---|---|",
    ]
    for family, who, config in families:
        exp = meshsim.expect(framework, WORLD, **config)
        cells = []
        for role in ("data_parallel", "gradient_reduce"):
            if role in exp.roles:
                cells.append(_code(exp.roles[role]))
            else:
                cells.append(
                    "unknown: the checks ask for `roles=`" if role in exp.unknown_roles else "none"
                )
        lines.append(
            f"| {_cell(family)} | {_cell(who)} | {_code(_config(config))} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def render(framework: str) -> str:
    """The generated part of one convention page."""
    parts = [
        "## Config keys",
        parameters_table(framework),
        "## Kinds and roles",
        kinds_table(framework),
    ]
    families = role_families_table(framework)
    if families is not None:
        parts += ["## Roles from dim names", families]
    return "\n\n".join([*parts, "## Refused configs", refusals_table(framework)])


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: replace ``<!-- generated: convention NAME -->`` with the tables.

    The pages describe the newest torch release, whichever torch builds the site (the
    reference otherwise follows the installed one: torchtitan's current line refuses every
    layout on torch 2.9), unless ``MESHSIM_TORCH_RELEASE`` pins another."""
    with newest_torch():
        return _MARKER.sub(lambda match: render(match.group(1)), markdown)


def newest_torch() -> AbstractContextManager[Any]:
    """``MESHSIM_TORCH_RELEASE=newest`` while the block runs, unless it is set already."""
    pin = {} if "MESHSIM_TORCH_RELEASE" in os.environ else {"MESHSIM_TORCH_RELEASE": "newest"}
    return mock.patch.dict(os.environ, pin)
