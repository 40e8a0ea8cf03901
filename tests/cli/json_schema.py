"""A validator for the part of JSON Schema meshsim's ``--json`` schemas use.

Keywords: ``type`` (one or a list), ``enum``, ``properties``, ``required``,
``additionalProperties`` (a boolean or a schema), ``items``; ``$schema``, ``$id``, ``title``
and ``description`` are annotations. Any other keyword is an error, so a schema can never lean
on a rule this validator would silently skip.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_RULES = {"type", "enum", "properties", "required", "additionalProperties", "items"}
_ANNOTATIONS = {"$schema", "$id", "title", "description"}


def errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Every place ``value`` breaks ``schema``, as ``path: problem`` lines ([] when valid)."""
    unknown = set(schema) - _RULES - _ANNOTATIONS
    if unknown:
        raise ValueError(f"{where}: the schema uses keywords this validator lacks: {unknown}")
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[name](value) for name in names):
            return [f"{where}: {type(value).__name__} {value!r:.60} is not {' or '.join(names)}"]
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        return [f"{where}: {value!r:.60} is not one of {schema['enum']}"]
    found: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        found += [
            f"{where}: missing {key!r}" for key in schema.get("required", ()) if key not in value
        ]
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                found += errors(item, properties[key], f"{where}.{key}")
            elif extra is False:
                found.append(f"{where}: {key!r} is not in the schema")
            elif isinstance(extra, dict):
                found += errors(item, extra, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += errors(item, schema["items"], f"{where}[{index}]")
    return found


def _equal(value: Any, allowed: Any) -> bool:
    """JSON equality: ``true`` is not ``1`` (Python's ``True == 1`` is)."""
    return type(value) is type(allowed) and value == allowed
