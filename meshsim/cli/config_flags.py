"""Config flags: ``--tensor-model-parallel-size 2``, ``--tp 2``, ``--set k=v`` to config dicts."""

from __future__ import annotations

import argparse
import difflib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from meshsim import options
from meshsim.errors import LayoutError, UsageError
from meshsim.model.conventions import CONVENTIONS, convention

#: Degrees every framework shares, each with a one-line meaning (the CLI's short flags).
DEGREES: Final[Mapping[str, str]] = {
    "tp": "tensor-parallel degree",
    "pp": "pipeline-parallel degree",
    "cp": "context/sequence-parallel degree (Ulysses SP in Megatron-DeepSpeed)",
    "dp": "data-parallel degree (inferred by most frameworks; checked when given)",
    "dp_replicate": "HSDP replicas (torchtitan dp_replicate, OLMo-core num_replicas)",
    "dp_shard": "HSDP shard degree (torchtitan dp_shard, OLMo-core shard_degree)",
    "ep": "expert-parallel degree",
    "etp": "expert tensor-parallel degree",
}

#: Shared degree -> each framework's parameter for it (the first candidate the framework's
#: PARAMETERS holds wins; frameworks without one infer it or do not have the axis).
TRANSLATION: Final[Mapping[str, tuple[str, ...]]] = {
    "tp": (
        "tensor_model_parallel_size",
        "tp",
        "tensor_parallel_size",
        "mp",
        "num_mp",
        "num_tp",
        "tp_size",
    ),
    "pp": ("pipeline_model_parallel_size", "pp", "pipeline_parallel_size", "num_pp", "pp_size"),
    "cp": ("context_parallel_size", "cp", "sequence_parallel_size", "sp", "cp_size"),
    "dp": ("data_parallel_size", "num_dp"),
    "dp_replicate": ("dp_replicate", "num_replicas", "dp_replicate_size"),
    "dp_shard": ("dp_shard", "shard_degree", "dp_shard_size", "fsdp_size"),
    "ep": ("expert_model_parallel_size", "ep", "expert_parallel_size", "ep_size"),
    "etp": ("expert_tensor_parallel_size", "etp", "etp_size"),
}

#: Config keys whose every flag occurrence is one list item (never split at commas).
LIST_KEYS: Final = frozenset({"ops"})
#: Keys whose value is a tuple even when one item is given (``--mesh-shape 8`` is ``(8,)``).
TUPLE_KEYS: Final = frozenset({"mesh_shape", "mesh_dim_names"})
_PREFIX: Final = "cfg:"
_DEGREE_PREFIX: Final = "deg:"


def parameters(framework: str) -> Mapping[str, str]:
    """The framework's PARAMETERS, with a one-line error when its model is missing."""
    module = convention(framework)  # LayoutError for an unknown name
    params = getattr(module, "PARAMETERS", None)
    if params is None:  # pragma: no cover - every convention module defines it
        raise UsageError(f"{framework}'s convention module defines no PARAMETERS")
    return params


def check_framework(framework: str) -> None:
    """Raise a one-line UsageError for an unknown framework or one whose model is missing."""
    if framework not in CONVENTIONS:
        close = difflib.get_close_matches(framework, list(CONVENTIONS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"unknown framework {framework!r}; known: {', '.join(CONVENTIONS)}{hint}")
    try:
        parameters(framework)
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"meshsim has no reference model for {framework!r} in this build "
            f"({exc.name} is missing)"
        ) from None


def flag(key: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + key.strip("_").replace("_", "-")


def native_key(framework: str, degree: str) -> str | None:
    """The framework's parameter for a shared degree, or None when it has none."""
    params = parameters(framework)
    return next((k for k in TRANSLATION[degree] if k in params), None)


def degree_of(framework: str, key: str) -> str | None:
    """The shared degree a framework parameter stands for (``tensor_model_parallel_size`` -> tp)."""
    return next((d for d in TRANSLATION if native_key(framework, d) == key), None)


def parse_value(text: str) -> Any:
    """Turn flag text into a config value.

    ``2`` -> 2, ``-1`` -> -1, ``none`` -> None, ``true`` -> True, ``2,4`` -> (2, 4),
    ``dp,tp`` -> ("dp", "tp"), ``tensor=tp,context=cp`` -> {"tensor": "tp", "context": "cp"},
    JSON (``[2, 4]``, ``{"tensor": "tp"}``) as JSON; anything else stays a string
    (``tp-cp-ep-dp-pp``, ``flatten dp,cp -> dp_cp``).
    """
    text = text.strip()
    if text[:1] in '[{"':
        try:
            return _tuples(json.loads(text))
        except json.JSONDecodeError as exc:
            raise UsageError(f"cannot parse {text!r} as JSON: {exc.msg}") from None
    lower = text.lower()
    if lower in ("none", "null"):
        return None
    if lower in ("true", "yes", "on"):
        return True
    if lower in ("false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if "," in text and not any(c.isspace() for c in text):
        parts = [p for p in text.split(",") if p]
        if all("=" in p for p in parts):
            return {k: parse_value(v) for k, _, v in (p.partition("=") for p in parts)}
        return tuple(parse_value(p) for p in parts)
    return text


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def parse_setting(text: str, framework: str | None = None) -> tuple[str, Any]:
    """``key=value`` (``--set``) -> (key, value); key may use dashes."""
    key, eq, value = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not eq or not key:
        where = f" for {framework}" if framework else ""
        raise UsageError(f"--set{where} takes key=value, got {text!r}")
    return key, (value if key in LIST_KEYS else parse_value(value))


def add_config_flags(
    parser: argparse.ArgumentParser, frameworks: Sequence[str], *, shared_only: bool = False
) -> None:
    """Add each framework's parameters as flags, the shared degree flags and ``--set``.

    A framework's own parameter names win over the shared short names (OLMo-core's ``--dp``
    is its DataParallelConfig name, ``ddp``/``fsdp``/``hsdp``). ``shared_only`` (``diff``)
    makes ``--tp``/``--dp``... always the shared degrees, translated for each side.
    """
    own: dict[str, str] = {}
    for framework in frameworks:
        for key, text in parameters(framework).items():
            if text.lower().startswith("callable"):
                continue  # functions cannot be written on a command line
            own.setdefault(key, f"{framework}: {text}")
    title = " / ".join(frameworks)
    group = parser.add_argument_group(f"{title} config (the framework's own parameter names)")
    taken: set[str] = set()
    for key, text in own.items():
        if shared_only and key in DEGREES:
            continue
        action = "append" if key in LIST_KEYS else "store"
        group.add_argument(
            flag(key), dest=_PREFIX + key, metavar="V", action=action, help=text.replace("%", "%%")
        )
        taken.add(key)
    shared = parser.add_argument_group("shared degrees (translated to each framework's parameter)")
    for degree, text in DEGREES.items():
        if degree not in taken:
            shared.add_argument(
                flag(degree),
                dest=_DEGREE_PREFIX + degree,
                type=options.integer(flag(degree), error=argparse.ArgumentTypeError),
                metavar="N",
                help=f"{text} ({_targets(frameworks, degree)})",
            )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config key, e.g. --set order=tp-cp-pp-ep-dp (repeatable)",
    )


def _targets(frameworks: Sequence[str], degree: str) -> str:
    """Where a shared degree goes in each framework: ``megatron: tensor_model_parallel_size``."""
    parts = []
    for framework in dict.fromkeys(frameworks):
        key = native_key(framework, degree)
        if framework == "torch":
            key = f"mesh dim {degree}" if degree in ("tp", "cp", "pp", "dp") else None
        parts.append(f"{framework}: {key or 'inferred' if degree.startswith('dp') else key or '-'}")
    return "; ".join(parts)


class Settings(dict[str, Any]):
    """Config values, each remembering the flag that set it.

    Two *different* flags that set one key to different values are refused, naming both
    (``--order X --set order=Y``): argparse would keep whichever came last and drop the other
    silently. The same flag repeated keeps its last value, as argparse does; a value with no
    flag (``flag=None``: a default a translation filled in) gives way to any flag.
    """

    def __init__(self, owner: str = "") -> None:
        super().__init__()
        self.owner = owner  # "megatron", or "megatron (B)" in a diff
        self.flags: dict[str, tuple[str | None, str]] = {}  # key -> (flag, as written)

    def put(self, key: str, value: Any, flag: str | None, written: str) -> None:
        before = self.flags.get(key)
        if before is not None and before[0] not in (None, flag) and self[key] != value:
            where = f"{self.owner} " if self.owner else ""
            raise UsageError(
                f"{before[1]} and {written} set the same {where}parameter {key!r} to different "
                "values; give one of them"
            )
        self[key] = value
        self.flags[key] = (flag, written)

    def written(self, key: str) -> str:
        """How the flag that set ``key`` was written (``--set order=tp-dp-pp``)."""
        return self.flags[key][1] if key in self.flags else f"{flag(key)} {self[key]}"

    def source(self, key: str) -> tuple[str | None, str]:
        return self.flags.get(key, (flag(key), self.written(key)))


def native_settings(namespace: argparse.Namespace) -> Settings:
    """Framework-parameter flags (``--order``) and ``--set`` items that were given, parsed;
    a flag and a ``--set`` of one key must agree."""
    out = Settings()
    for dest, value in vars(namespace).items():
        if dest.startswith(_PREFIX) and value is not None:
            key = dest[len(_PREFIX) :]
            parsed = tuple(value) if key in LIST_KEYS else parse_value(value)
            if key in TUPLE_KEYS and not isinstance(parsed, tuple):
                parsed = (parsed,)
            text = " ".join(value) if key in LIST_KEYS else value
            out.put(key, parsed, flag(key), f"{flag(key)} {text}")
    for text in namespace.settings:
        key, value = parse_setting(text)
        if key in LIST_KEYS:  # list items accumulate, whichever flag gives them
            value = (*out.get(key, ()), value)
            out[key] = value
            out.flags[key] = ("--set", f"--set {text}")
            continue
        if key in TUPLE_KEYS and not isinstance(value, tuple):
            value = (value,)
        out.put(key, value, "--set", f"--set {text}")
    return out


def shared_degrees(namespace: argparse.Namespace) -> dict[str, int]:
    """Shared degree flags that were given."""
    return {
        dest[len(_DEGREE_PREFIX) :]: value
        for dest, value in vars(namespace).items()
        if dest.startswith(_DEGREE_PREFIX) and value is not None
    }


def config_for(
    framework: str, world_size: int, native: Mapping[str, Any], degrees: Mapping[str, int]
) -> dict[str, Any]:
    """One framework's config: the shared degrees translated, then its own settings on top.

    A shared degree and the framework's own flag for the same parameter must agree
    (``--tp 2 --tensor-model-parallel-size 4`` is refused, naming both flags).
    """
    config = translated(framework, world_size, degrees)
    for key, value in native.items():
        source = native.source(key) if isinstance(native, Settings) else (flag(key), flag(key))
        config.put(key, value, *source)
    return dict(config)


def translated(
    framework: str,
    world_size: int,
    degrees: Mapping[str, int],
    written: Mapping[str, str] | None = None,
    owner: str | None = None,
) -> Settings:
    """:func:`translate` as :class:`Settings`: each translated parameter remembers the degree
    flag behind it (``written``: degree -> how it was given, default ``--tp 2``); what the
    translation fills in besides (OLMo-core's ``dp=fsdp``) is a default any flag overrides."""
    config = Settings(framework if owner is None else owner)
    if not degrees:
        return config
    said = {d: (written or {}).get(d, f"{flag(d)} {v}") for d, v in degrees.items()}
    behind = {native_key(framework, d): d for d in degrees} if framework != "torch" else {}
    for key, value in translate(framework, world_size, degrees).items():
        if framework == "torch":  # the whole mesh comes from the degrees given
            config.put(key, value, "degrees", " ".join(said.values()))
        elif key in behind:
            config.put(key, value, flag(behind[key]), said[behind[key]])
        else:
            config.put(key, value, None, f"{key}={value} (filled in)")
    return config


def translate(framework: str, world_size: int, degrees: Mapping[str, int]) -> dict[str, Any]:
    """Shared degrees -> ``framework``'s config, filling in what it needs to build them.

    * Megatron, Megatron-DeepSpeed, DeepSpeed, torchtitan: renamed parameters; dp is inferred
      there, so a given ``dp`` is only checked against world / (tp·cp·pp).
    * OLMo-core: a DP config is needed with any other degree, so ``dp`` defaults to ``fsdp``,
      or ``hsdp`` when dp_replicate/dp_shard/ep are given (EP needs HSDP, on dp_shard = ep).
    * torch: the mesh (pp, dp, cp, tp) with dp inferred and dp,cp flattened into dp_cp, the
      layout torchtitan and Megatron's default order share.

    Example: ``translate("megatron", 16, {"tp": 2, "pp": 4})`` is
    ``{"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4}``.
    """
    _check_dp(framework, world_size, degrees)
    if framework == "torch":
        return _torch_mesh(world_size, degrees)
    config: dict[str, Any] = {}
    for degree, value in degrees.items():
        key = native_key(framework, degree)
        if key is not None:
            config[key] = value
        elif degree in ("dp", "dp_replicate", "dp_shard"):
            continue  # inferred by the framework; checked above
        elif value != 1:
            raise LayoutError(f"{framework} has no {DEGREES[degree]} ({flag(degree)} {value})")
    if framework == "olmo-core" and "dp" not in config:
        hsdp = {"dp_replicate", "dp_shard", "ep"} & set(degrees)
        config["dp"] = "hsdp" if hsdp else "fsdp"
        if "ep" in degrees and not {"dp_replicate", "dp_shard"} & set(degrees):
            config["shard_degree"] = degrees["ep"]
    return config


def _check_dp(framework: str, world_size: int, degrees: Mapping[str, int]) -> None:
    """A given dp (or HSDP split) must be what the other degrees leave of the world."""
    model = math.prod(degrees.get(d, 1) for d in ("tp", "cp", "pp"))
    if model <= 0:
        return  # a degree below 1: the framework's own rule refuses it (or reads 0 its way)
    dp = world_size / model
    checks = [("dp", degrees.get("dp"), dp)]
    if "dp_replicate" in degrees and "dp_shard" in degrees:
        product = degrees["dp_replicate"] * degrees["dp_shard"]
        checks.append(("dp_replicate × dp_shard", product, dp))
    for name in ("dp_replicate", "dp_shard"):
        if name in degrees and degrees[name] > 0 and dp % degrees[name]:
            raise LayoutError(
                f"{name} = {degrees[name]} does not divide the data-parallel size {dp:g} "
                f"(world size {world_size} / tp·cp·pp {model}) for {framework}"
            )
    for name, given, want in checks:
        if given is not None and given != want:
            raise LayoutError(
                f"{name} = {given} does not fit world size {world_size} with tp·cp·pp = {model} "
                f"(dp must be {want:g}) for {framework}"
            )


def _torch_mesh(world_size: int, degrees: Mapping[str, int]) -> dict[str, Any]:
    extra = sorted(d for d, v in degrees.items() if d in ("ep", "etp") and v != 1)
    if extra:
        raise LayoutError(f"the torch convention has no {', '.join(extra)} degree")
    tp, cp, pp = (degrees.get(d, 1) for d in ("tp", "cp", "pp"))
    small = [f"{flag(d)} {degrees[d]}" for d in ("tp", "cp", "pp") if degrees.get(d, 1) < 1]
    if small:
        raise LayoutError(f"{', '.join(small)}: every torch mesh dim must have size >= 1")
    if world_size % (tp * cp * pp):
        raise LayoutError(
            f"world size {world_size} is not divisible by tp·cp·pp = {tp}·{cp}·{pp} "
            f"= {tp * cp * pp}"
        )
    dp = world_size // (tp * cp * pp)
    return {
        "mesh_shape": (pp, dp, cp, tp),
        "mesh_dim_names": ("pp", "dp", "cp", "tp"),
        "ops": ("flatten dp,cp -> dp_cp",),
    }


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``megatron:order=tp-cp-pp-ep-dp:context_parallel_size=2`` -> (framework, settings)."""
    framework, *settings = spec.split(":")
    check_framework(framework)
    return framework, dict(parse_setting(s, framework) for s in settings if s)
