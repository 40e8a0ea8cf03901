"""Turn the body (fn, args, kwargs) into bytes for worker processes, naming what cannot go.

dill pickles closures and functions defined inside tests by value; functions of importable
modules travel by reference and are imported in the worker (which gets the caller's
``sys.path`` and working directory). When pickling fails, each part is tried on its own so
the error can name the culprit.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any

from meshsim.errors import UsageError
from meshsim.harness.outcome import body_name


def dumps(obj: Any) -> bytes:
    """dill with ``recurse=True``: only the globals a function uses travel with it."""
    import io

    buffer = io.BytesIO()
    _pickler_class()(buffer, recurse=True).dump(obj)
    return buffer.getvalue()


_PICKLER: type | None = None


def _pickler_class() -> type:
    """A dill Pickler that sends importable modules by name.

    dill pickles every module outside the standard library and site-packages *by value*, with
    its whole ``__dict__`` (it assumes such a module is the user's script). That drags in
    thread locals, locks and open files: a body that merely mentions ``meshsim`` (an editable
    install) or a project module could not be sent. Modules the worker can import are sent by
    name instead; ``__main__`` and unimportable modules keep dill's by-value behaviour.
    """
    global _PICKLER
    if _PICKLER is None:
        import sys

        import dill

        def save_module(pickler: Any, module: types.ModuleType) -> None:
            name = module.__name__
            importable = sys.modules.get(name) is module and getattr(module, "__spec__", None)
            if name != "__main__" and importable:
                pickler.save_reduce(_import_module, (name,), obj=module)
            else:
                dill._dill.save_module(pickler, module)

        class ModulesByName(dill.Pickler):  # type: ignore[misc]
            dispatch = dill.Pickler.dispatch.copy()

        ModulesByName.dispatch[types.ModuleType] = save_module
        _PICKLER = ModulesByName
    return _PICKLER


def _import_module(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(name)


def loads(data: bytes) -> Any:
    import dill

    return dill.loads(data)


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _parts(fn: Any, args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for i, arg in enumerate(args):
        yield f"args[{i}] ({type(arg).__name__})", arg
    for key, value in kwargs.items():
        yield f"kwargs[{key!r}] ({type(value).__name__})", value
    func = getattr(fn, "func", None) if not isinstance(fn, types.FunctionType) else None
    if func is not None:  # functools.partial
        yield from _parts(func, tuple(getattr(fn, "args", ())), getattr(fn, "keywords", {}))
        return
    func = getattr(fn, "__func__", fn)
    if getattr(fn, "__self__", None) is not None:
        yield f"the bound object {type(fn.__self__).__name__}", fn.__self__
    code = getattr(func, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, func.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        yield f"the variable {name!r} ({type(value).__name__}) captured by the closure", value
    globs = getattr(func, "__globals__", {})
    for name in dict.fromkeys(_names(code)):
        if name in globs and not isinstance(globs[name], types.ModuleType):
            value = globs[name]
            yield f"the global {name!r} ({type(value).__name__})", value
    for i, default in enumerate(func.__defaults__ or ()):
        yield f"default argument #{i} ({type(default).__name__})", default


def dumps_body(fn: Any, args: tuple, kwargs: Mapping[str, Any], backend: str) -> bytes:
    """The pickled ``(fn, args, kwargs)``; ``UsageError`` naming the culprit if impossible."""
    try:
        return dumps((fn, tuple(args), dict(kwargs)))
    except Exception as exc:
        error = exc
    culprit = "the body itself"
    reason = f"{type(error).__name__}: {error}"
    for label, value in _parts(fn, tuple(args), kwargs):
        try:
            dumps(value)
        except Exception as exc:
            culprit, reason = label, f"{type(exc).__name__}: {exc}"
            break
    raise UsageError(
        f"the {backend} tier runs the body in worker processes, but {culprit} used by "
        f"{body_name(fn)} cannot be pickled by dill ({reason}). Create that object inside the "
        "body, pass something picklable through args=/kwargs=, or define it at module level "
        "of an importable module; or use backend='threaded', which needs no pickling."
    ) from error
