"""OLMo-core: ``build_world_mesh``, ``build_expert_parallel_mesh`` and every ``get_*_mesh`` getter.

Modelled on ``olmo_core/distributed/parallel/__init__.py`` (snapshot fa6c5014). The world mesh is
``init_device_mesh`` over the dims of the configs that are present, in the order ``pp``, ``dp`` or
(``dp_replicate``, ``dp_shard``), ``cp``, ``tp``; a present config of degree 1 still makes a size-1
dim. Kinds are the mesh dims, the names the getters flatten on the root (``dp_cp``, and ``dp`` for
HSDP's process group), and one kind per getter named after it; a getter that raises under a config
is a kind whose source is OLMo's "could not determine ..." error.

The ``dp`` + ``ep`` -> ``dp_ep`` flatten exists upstream but is unreachable from
``build_world_mesh`` (EP needs HSDP, which reuses ``dp_shard``), so no ``dp_ep`` kind ever appears.
``build_expert_parallel_mesh`` (config key ``expert_mesh_ep``) adds ``ep_replicate``, ``ep_shard``
and the same getters on that mesh, prefixed ``expert:`` (``expert:get_ep_mesh``, ``expert:dp``);
the mesh itself, dim names and shape, is ``Expected.meshes["expert"]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from meshsim.errors import LayoutError
from meshsim.model.conventions import reject_unknown, upstream_error
from meshsim.model.conventions._olmo_core_configs import DP_TYPES as _DP_TYPES
from meshsim.model.conventions._olmo_core_configs import configs as configs
from meshsim.model.conventions._olmo_core_configs import refused_configs as refused_configs
from meshsim.model.expected import Expected, Kind
from meshsim.model.layout import Layout

PARAMETERS: Final[Mapping[str, str]] = {
    "dp": "DataParallelConfig.name: 'ddp', 'fsdp' or 'hsdp' (None: no data-parallel config)",
    "num_replicas": "HSDP replicas (None: derived from shard_degree, else num_nodes)",
    "shard_degree": "HSDP shard degree (None: derived from num_replicas, else dp world/num_nodes)",
    "tp": "TensorParallelConfig.degree (None: no TP config; 1 still makes a size-1 'tp' dim)",
    "cp": "ContextParallelConfig.degree (None: no CP config)",
    "pp": "PipelineParallelConfig.degree (None: no PP config)",
    "ep": "ExpertParallelConfig.degree (None: no EP config; < 0: the HSDP shard degree)",
    "num_nodes": "stand-in for env NUM_NODES (or world/LOCAL_WORLD_SIZE) for the HSDP default "
    "split (default 1, as in OLMo's own tests)",
    "expert_mesh_ep": "also build_expert_parallel_mesh with this degree (< 0: the whole world)",
}

_CONFIG_CLASS: Final = {
    "pp": "PipelineParallelConfig",
    "cp": "ContextParallelConfig",
    "tp": "TensorParallelConfig",
    "ep": "ExpertParallelConfig",
}
_GETTERS: Final[Mapping[str, str]] = {
    "get_dp_mesh": "data-loading DP sub-mesh: every dim named dp*, never cp",
    "get_dp_process_group": "data-loading DP process group (HSDP's 2-D DP mesh flattened to 'dp')",
    "get_dp_model_mesh": "DDP/FSDP wrapper mesh: DP dims with cp folded into the dp dim before it",
    "get_tp_mesh": "tensor-parallel sub-mesh",
    "get_cp_mesh": "context-parallel sub-mesh",
    "get_pp_mesh": "pipeline-parallel sub-mesh",
    "get_pp_stage_mesh": "every non-pp dim: the ranks of one pipeline stage",
    "get_ep_mesh": "expert-parallel sub-mesh: the first of ep, ep_shard, dp_shard",
    "get_dp_shard_mesh": "HSDP shard dim of the model mesh",
    "get_dp_replicate_mesh": "HSDP replicate dim of the model mesh",
}


_error = upstream_error("OLMoConfigurationError")


def expect(world_size: int, **config: Any) -> Expected:
    """Every group OLMo-core builds for ``config`` on ``world_size`` ranks.

    Example: ``expect(8, dp="hsdp", num_replicas=2, cp=2)`` has a (dp_replicate, dp_shard, cp)
    = (2, 2, 2) world mesh; ``groups("get_dp_model_mesh")`` is ``[(0, ..., 7)]`` (the 2-D
    (dp_replicate, dp_cp) mesh) while ``groups("get_dp_process_group")`` is ``[(0, 2, 4, 6),
    (1, 3, 5, 7)]``.
    """
    reject_unknown("olmo-core", config, PARAMETERS)
    cfg = _normalize(config)
    root = Layout(_world_dims(world_size, cfg))
    kinds, root = _mesh_kinds(root, prefix="")
    roles: dict[str, str] = {
        "data_parallel": "get_dp_process_group",
        "gradient_reduce": "get_dp_model_mesh",
        # OLMo divides each rank's summed loss by the batch's token count / cp degree, and FSDP/DDP
        # average the resulting gradients over get_dp_model_mesh (dp x cp): that mesh is the domain
        # the loss is effectively reduced over, CP shards included.
        "loss": "get_dp_model_mesh",
    }
    if cfg["dp"] is None:
        # No data-parallel config: build_world_mesh still makes a dp mesh of every rank (and
        # the loader splits batches over it), but parallelize_model applies no DDP/FSDP, so
        # no gradient is reduced (docs/findings.md).
        del roles["gradient_reduce"], roles["loss"]
    for role, getter in (("tensor", "tp"), ("context", "cp"), ("pipeline", "pp")):
        if kinds[f"get_{getter}_mesh"].available:
            roles[role] = f"get_{getter}_mesh"
    if cfg["ep"] is not None:
        roles["expert"] = "get_ep_mesh"  # HSDP + EP: the ep mesh is dp_shard
    meshes: dict[str, Layout] = {}
    if cfg["expert_mesh_ep"] is not None:
        meshes["expert"] = _expert_root(world_size, cfg["expert_mesh_ep"])
        expert_kinds, _ = _mesh_kinds(meshes["expert"], "expert:")
        kinds.update(expert_kinds)
        # A dedicated expert mesh is what the MoE layers use when it is built.
        roles["expert"] = "expert:get_ep_mesh"
        roles["expert_data"] = "ep_replicate"
    normal = {k: v for k, v in cfg.items() if v is not None}
    return Expected(
        "olmo-core", world_size, normal, kinds.values(), roles, layout=root, meshes=meshes
    )


def _normalize(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = {key: config.get(key) for key in PARAMETERS}
    dp = cfg["dp"]
    if dp is not None:
        dp = str(getattr(dp, "value", dp))
        if dp not in _DP_TYPES:
            raise LayoutError(
                f"dp must be one of {_DP_TYPES} or None, got {cfg['dp']!r}", upstream="ValueError"
            )
        cfg["dp"] = dp
    for key in (
        "tp",
        "cp",
        "pp",
        "ep",
        "expert_mesh_ep",
        "num_replicas",
        "shard_degree",
        "num_nodes",
    ):
        value = cfg[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LayoutError(f"{key} must be an integer degree or None, got {value!r}")
    for key in ("num_replicas", "shard_degree", "num_nodes"):
        if cfg[key] is not None and (isinstance(cfg[key], bool) or cfg[key] < 1):
            raise LayoutError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    return cfg


def world_dims(world_size: int, config: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``build_world_mesh``'s checks, in OLMo's order, and its world mesh's (name, size) dims.

    An HSDP split that does not cover the DP world passes: OLMo hands it to torch unchecked,
    and a builder lets torch refuse it (:func:`expect` refuses it itself, see
    :func:`_split_error`). Example: world 8, ``dp="hsdp", num_replicas=2, cp=2`` gives
    ``[("dp_replicate", 2), ("dp_shard", 2), ("cp", 2)]``.
    """
    return _world_dims(world_size, _normalize(config), split_checked=False)


def _world_dims(
    world_size: int, cfg: Mapping[str, Any], *, split_checked: bool = True
) -> list[tuple[str, int]]:
    """``build_world_mesh``: validation in OLMo's order, then the dims of the present configs."""
    dp, pp, cp, tp, ep = cfg["dp"], cfg["pp"], cfg["cp"], cfg["tp"], cfg["ep"]
    if dp is None and pp is None and cp is None and tp is None and ep is None:
        return [("dp", world_size)]
    if dp is None:
        raise _error(
            "Data parallel config is required in addition to expert/tensor/context/pipeline "
            "parallel configs"
        )
    dp_world = world_size
    for key, degree in (("pp", pp), ("cp", cp), ("tp", tp)):
        if degree is not None:
            if degree < 1 or dp_world % degree != 0:
                raise _error(
                    f"{_CONFIG_CLASS[key]}.degree must be at least 1 and divide into the world size"
                )
            dp_world //= degree
    if ep is not None:
        # Python's % on a negative degree: -1 always divides, which is how "ep < 0" gets through.
        if ep == 0 or dp_world % ep != 0:
            raise _error(
                f"{_CONFIG_CLASS['ep']}.degree must be at least 1 and divide into the world size"
            )
        if tp is not None:
            raise _error("expert parallelism is mutually exclusive with tensor parallism")
        if dp != "hsdp":
            raise _error("expert parallelism can currently only be used with HSDP data parallelism")

    dims: list[tuple[str, int]] = [("pp", pp)] if pp is not None else []
    split: tuple[int, int, str] | None = None
    if dp == "hsdp":
        split = _replicate_and_shard(dp_world, cfg)
        replicas, shard, _ = split
        dims += [("dp_replicate", replicas), ("dp_shard", shard)]
        if ep is not None and ep >= 0 and ep != shard:
            raise _error("expert parallelism + HSDP requires the same sharding degree")
    else:
        dims.append(("dp", dp_world))
    dims += [(key, degree) for key, degree in (("cp", cp), ("tp", tp)) if degree is not None]
    # OLMo leaves this to init_device_mesh; the reference says what torch then raises.
    if split_checked and split is not None and split[0] * split[1] != dp_world:
        raise _split_error(world_size, dp_world, dims, split)
    return dims


def _replicate_and_shard(dp_world: int, cfg: Mapping[str, Any]) -> tuple[int, int, str]:
    """``DataParallelConfig.get_replicate_and_shard_degree``: (num_replicas, shard_degree, how
    they were chosen). OLMo checks that a *given* value divides the DP world, never that the
    product is the DP world (``build_world_mesh`` finds out, see :func:`_split_error`)."""
    replicas, shard = cfg["num_replicas"], cfg["shard_degree"]
    for key, value in (("num_replicas", replicas), ("shard_degree", shard)):
        if value is not None and dp_world % value != 0:
            raise _error(
                f"data parallel world size ({dp_world}) must be divisible by '{key}' ({value})"
            )
    if replicas is None and shard is None:
        num_nodes = cfg["num_nodes"] or 1
        replicas, shard = num_nodes, dp_world // num_nodes
        how = f"num_replicas=num_nodes={num_nodes} x shard_degree={dp_world}//{num_nodes}={shard}"
    elif shard is None:
        shard = dp_world // replicas
        how = f"num_replicas={replicas} x shard_degree={shard}"
    elif replicas is None:
        replicas = dp_world // shard
        how = f"num_replicas={replicas} x shard_degree={shard}"
    else:
        how = f"num_replicas={replicas} x shard_degree={shard}"
    return replicas, shard, how


def _split_error(
    world_size: int, dp_world: int, dims: list[tuple[str, int]], split: tuple[int, int, str]
) -> LayoutError:
    """What ``build_world_mesh`` does with an HSDP split whose product is not the DP world.

    OLMo passes the split to ``init_device_mesh`` unchecked (ai2-olmo-core 3.0.0, torch 2.13):
    a shard degree of 0 (num_nodes > DP world) fails in torch with ZeroDivisionError; a mesh
    bigger than the world with RuntimeError; a smaller one is built on ranks ``0..n-1`` only, and
    the ranks outside it fail in the ``get_dp_process_group`` call ``build_world_mesh`` makes: an
    IndexError in ``DeviceMesh.get_group`` when the DP mesh spans the whole world mesh (every
    pp/cp/tp dim absent or of size 1; EP adds no dim), a RuntimeError slicing the world mesh when
    a pp/cp/tp dim of size > 1 makes the DP mesh a proper slice of it (torch's
    ``_get_mesh_tensor_from_full_mesh`` needs the rank in the mesh then). The ranks
    inside the mesh build their groups, so no answer holds for every rank: meshsim refuses the
    config with the error the ranks outside the mesh see.
    """
    replicas, shard, how = split
    names = tuple(n for n, _ in dims)
    shape = tuple(s for _, s in dims)
    size = math.prod(shape)
    mesh = f"world mesh {names} = {shape}"
    if size == 0:
        return LayoutError(
            f"HSDP split {how} has a shard degree of 0 (the data parallel world size is "
            f"{dp_world}), so torch fails building OLMo's {mesh} with ZeroDivisionError: integer "
            f"modulo by zero",
            upstream="ZeroDivisionError",
        )
    if size > world_size:
        return LayoutError(
            f"HSDP split {how} = {replicas * shard} exceeds the data parallel world size "
            f"{dp_world}, so init_device_mesh refuses OLMo's {mesh}: Mesh should not be bigger "
            f"than default world size {world_size}, but found {size} ranks!",
            upstream="RuntimeError",
        )
    if size == replicas * shard:  # pp/cp/tp absent or of size 1: the DP mesh is the world mesh
        upstream, failure = "IndexError", "IndexError (list index out of range) in get_group"
    else:
        upstream = "RuntimeError"
        failure = (
            "RuntimeError slicing the world mesh (In order to get the mesh Tensor of a "
            "DeviceMesh it needs to either have all its original dimensions (e.g., no slicing) "
            "or it needs to contain the local rank)"
        )
    outside = f"rank {size}" if size == world_size - 1 else f"ranks {size}-{world_size - 1}"
    return LayoutError(
        f"HSDP split {how} covers {replicas * shard} of the {dp_world} data-parallel ranks, so "
        f"OLMo builds its {mesh} on ranks 0-{size - 1} of {world_size} only, and {outside}, "
        f"outside it, fail in get_dp_process_group with {failure}; choose num_replicas x "
        f"shard_degree = {dp_world}",
        upstream=upstream,
    )


def _expert_root(world_size: int, degree: int) -> Layout:
    """``build_expert_parallel_mesh``: (ep_replicate, ep_shard) = (world / ep, ep)."""
    return Layout(expert_dims(world_size, degree))


def expert_dims(world_size: int, degree: int) -> list[tuple[str, int]]:
    """``build_expert_parallel_mesh``'s checks and its mesh's dims: world 8, degree 2 gives
    ``[("ep_replicate", 4), ("ep_shard", 2)]``; a degree < 0 is the whole world."""
    ep = world_size if degree < 0 else degree
    if ep == 0:
        raise LayoutError(
            "build_expert_parallel_mesh with degree 0 divides by zero; use a degree >= 1 or < 0",
            upstream="ZeroDivisionError",
        )
    if world_size % ep != 0:
        raise _error(
            f"Expert parallelism requires world size ({world_size}) to be divisible by 'degree' "
            f"({ep})"
        )
    return [("ep_replicate", world_size // ep), ("ep_shard", ep)]


# -- the getters, on a Layout standing for the mesh -----------------------------------------------
Names = tuple[str, ...]


def flattened_names(names: Names, dims: Names, name: str) -> Names:
    """``_flatten_dims``' renaming: ``dims`` in ``names`` become one ``name`` where the first
    of them stood: ``("dp_replicate", "dp_shard", "cp")`` with ``("dp_shard", "cp")`` flattened
    to ``"dp_cp"`` reads ``("dp_replicate", "dp_cp")``."""
    out: list[str] = []
    for n in names:
        if n not in dims:
            out.append(n)
        elif name not in out:
            out.append(name)
    return tuple(out)


def _flatten_dims(root: Layout, dims: Names, name: str, names: Names) -> tuple[Layout, Names]:
    """``_flatten_dims``: register ``name`` on the root, and rename ``dims`` in ``names``."""
    return root[dims].flatten(name=name).root(), flattened_names(names, dims, name)


def _fold_ep(root: Layout, names: Names) -> tuple[Layout, Names]:
    if "dp" in names and "ep" in names:  # unreachable from build_world_mesh; kept as upstream
        return _flatten_dims(root, ("dp", "ep"), "dp_ep", names)
    if "ep_replicate" in names and "ep_shard" in names:
        return _flatten_dims(root, ("ep_replicate", "ep_shard"), "dp", names)
    return root, names


def _model_mesh(root: Layout) -> tuple[Layout, Names]:
    """``_get_model_mesh``: fold ep dims into dp, then cp into the dp dim just before it."""
    root, names = _fold_ep(root, root.root_names)
    if "cp" in names:
        last_dp = names[names.index("cp") - 1]
        assert last_dp.startswith("dp")  # as upstream; build_world_mesh guarantees it
        root, names = _flatten_dims(root, (last_dp, "cp"), "dp_cp", names)
    return root, names


def _missing(what: str, names: Names) -> LayoutError:
    return LayoutError(
        f"could not determine {what} sub-mesh from mesh with dimensions {names}",
        upstream="RuntimeError",
    )


def _dp_names(names: Names) -> Names:
    return tuple(n for n in names if n.startswith("dp"))


def get_dp_mesh(root: Layout) -> Layout:
    root, names = _fold_ep(root, root.root_names)
    if "dp_cp" in names:
        raise LayoutError(
            "'get_dp_mesh' should be called on the original world mesh", upstream="RuntimeError"
        )
    return root[_dp_names(names)]


def get_dp_process_group(root: Layout) -> Layout:
    mesh = get_dp_mesh(root)
    return mesh.flatten(name="dp") if mesh.ndim > 1 else mesh


def get_dp_model_mesh(root: Layout) -> Layout:
    root, names = _model_mesh(root)
    return root[_dp_names(names)]


def _model_dim(root: Layout, dim: str, what: str) -> Layout:
    root, names = _model_mesh(root)
    if dim not in names:
        raise _missing(what, names)
    return root[dim]


def _root_dim(root: Layout, dims: Names, what: str) -> Layout:
    for dim in dims:
        if dim in root.root_names:
            return root[dim]
    raise _missing(what, root.root_names)


def get_pp_stage_mesh(root: Layout) -> Layout:
    _root_dim(root, ("pp",), "pipeline parallel")
    return root[tuple(n for n in root.root_names if n != "pp")]


_GETTER_FUNCTIONS: Final[Mapping[str, Callable[[Layout], Layout]]] = {
    "get_dp_mesh": get_dp_mesh,
    "get_dp_process_group": get_dp_process_group,
    "get_dp_model_mesh": get_dp_model_mesh,
    "get_tp_mesh": lambda r: _model_dim(r, "tp", "tensor parallel"),
    "get_cp_mesh": lambda r: _root_dim(r, ("cp",), "context parallel"),
    "get_pp_mesh": lambda r: _root_dim(r, ("pp",), "pipeline parallel"),
    "get_pp_stage_mesh": get_pp_stage_mesh,
    "get_ep_mesh": lambda r: _root_dim(r, ("ep", "ep_shard", "dp_shard"), "expert parallel"),
    "get_dp_shard_mesh": lambda r: _model_dim(r, "dp_shard", "data parallel shard"),
    "get_dp_replicate_mesh": lambda r: _model_dim(r, "dp_replicate", "data parallel replicate"),
}


def _view_kind(name: str, description: str, view: Layout | LayoutError) -> Kind:
    if isinstance(view, LayoutError):
        return Kind(name, description, view)
    return Kind(name, description, view.groups, mesh_dims=view.dim_names, mesh_shape=view.shape)


def _mesh_kinds(root: Layout, prefix: str) -> tuple[dict[str, Kind], Layout]:
    """Kinds of one mesh: its dims, the names its getters flatten, and one kind per getter.

    Dims keep their names (``ep_replicate``/``ep_shard`` cannot clash with world dims); flattened
    names and getters of the expert mesh take ``prefix``. Also returns the root with every
    flattened name registered, as OLMo's getters leave the world mesh.
    """
    views: dict[str, Layout | LayoutError] = {}
    for getter, function in _GETTER_FUNCTIONS.items():
        try:
            views[getter] = function(root)
        except LayoutError as error:
            views[getter] = error
    full = root
    for view in views.values():
        if isinstance(view, Layout):
            for alias, axes in view.root().aliases.items():
                if alias not in full.aliases:
                    full = full[axes].flatten(name=alias).root()
    where = "expert mesh" if prefix else "world mesh"
    kinds: dict[str, Kind] = {}
    for dim in root.root_names:
        kinds[dim] = _view_kind(dim, f"{where} dim {dim!r}", root[dim])
    for alias, axes in full.aliases.items():
        name = prefix + alias
        kinds[name] = _view_kind(name, f"{where}: _flatten of {axes} into {alias!r}", full[alias])
    for getter, view in views.items():
        kinds[prefix + getter] = _view_kind(prefix + getter, f"{where}: {_GETTERS[getter]}", view)
    return kinds, full
