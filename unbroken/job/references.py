"""References to user code that every worker process can resolve: ``module:function`` or ``/path/file.py:function``.

A user's model, data and optimizer factories reach the worker processes as
text in the run's config (``model.factory``, ``data.factory``,
``optim.factory``), never as pickled objects. :func:`reference_of` turns a
function into such a text; :func:`resolve` turns the text back into the
function inside a worker.

A function defined in a script run as ``python script.py`` lives in module
``__main__``, which another process cannot import: its reference names the
script's file instead, and a worker loads that file as a module of its own
name (not ``__main__``), so the script's ``if __name__ == "__main__":`` block,
which starts the job, does not run again in the worker.

A file reference is made absolute where the job is launched
(:func:`anchor_references`, against the launching directory), so every
worker loads the same file whatever its own working directory. Loading it
never puts the script's folder ahead of installed packages on ``sys.path``
(a script in a shared folder such as ``/tmp`` would otherwise let anyone who
can write there shadow a module every worker imports later): the folder is
appended, so the script's own sibling modules still import.

Invariants: resolving a reference twice in one process gives the same object
(files are loaded once); a reference names a module-level attribute, so every
process resolves it to the same code.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["anchor_references", "reference_of", "resolve", "resolve_all"]

FACTORY_FIELDS = (("model", "factory"), ("model", "parallelize"), ("data", "factory"), ("optim", "factory"))
"""The config fields that hold references to user code."""

_FILE_MODULE_PREFIX = "unbroken_user_"


def reference_of(obj: Callable[..., Any] | str, *, field: str) -> str:
    """The reference text of ``obj`` (a module-level function or class, or a reference already).

    Raises:
        ValueError: ``obj`` is a lambda, a nested function or a bound method
            (no other process can find it), or a ``__main__`` attribute without a file.
    """
    if isinstance(obj, str):
        _split(obj, field)
        return obj
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not callable(obj) or qualname is None or module is None or "<" in qualname or "." in qualname:
        raise ValueError(f"{field}={obj!r}: give a function or class defined at the top level of a module "
                         "(workers are separate processes and find it by module and name; no lambdas, "
                         "nested functions or bound methods)")
    if module != "__main__":
        return f"{module}:{qualname}"
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file is None:
        raise ValueError(f"{field}={qualname} is defined in an interactive session; define it in a module or "
                         "script file so that the worker processes can load it")
    return f"{Path(main_file).resolve()}:{qualname}"


def resolve(reference: str, *, field: str) -> Any:
    """The object a reference names, imported (or loaded from its file) in this process.

    Raises:
        ValueError: malformed reference, unknown module or file, or missing attribute (names which and the fix).
    """
    where, name = _split(reference, field)
    if where.endswith(".py"):
        module = _load_file(Path(where), field)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(f"{field}={reference!r}: cannot import module {where!r} ({exc}); make it importable "
                             "in the worker processes (PYTHONPATH) or name a file: '/path/file.py:function'") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{field}={reference!r}: {where} has no attribute {name!r}") from None


def resolve_all(cfg: Any) -> None:
    """Resolve every reference of ``cfg`` (its factory fields), loading their modules in this process.

    Raises:
        ValueError: a reference that does not resolve, with the file's line where loading it failed.
    """
    for section, name in FACTORY_FIELDS:
        if ref := getattr(getattr(cfg, section), name):
            resolve(ref, field=f"{section}.{name}")


def anchor_references(cfg: Any, base: Path | None = None) -> None:
    """Make every file reference of ``cfg`` (its factory fields) absolute against ``base`` (default: the
    current directory, the launching one), in place."""
    for section, name in FACTORY_FIELDS:
        ref = getattr(getattr(cfg, section), name)
        if not ref:
            continue
        where, name_ = _split(ref, f"{section}.{name}")
        if where.endswith(".py") and not Path(where).is_absolute():
            setattr(getattr(cfg, section), name, f"{((base or Path.cwd()) / where).resolve()}:{name_}")


def _split(reference: str, field: str) -> tuple[str, str]:
    where, sep, name = reference.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{field}={reference!r}: expected 'module:function' or '/path/file.py:function'")
    return where, name


def _load_file(path: Path, field: str) -> Any:
    if not path.is_absolute():
        raise ValueError(f"{field}: file {str(path)!r} is a relative path; the job makes it absolute where it is "
                         "launched, so give an absolute one here")
    if not path.is_file():
        raise ValueError(f"{field}: file {str(path)!r} does not exist (give an absolute path to the script)")
    path = path.resolve()
    name = _FILE_MODULE_PREFIX + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # The script's folder last on the path: its sibling modules import, but never ahead of installed ones.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file does not load: said once, where it is checked (before any start)
        del sys.modules[name]
        line = next((f.lineno for f in reversed(traceback.extract_tb(exc.__traceback__))
                     if f.filename == str(path)), None)
        raise ValueError(f"{field}: loading {path}{f' (line {line})' if line else ''} failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        del sys.modules[name]
        raise
    return module
