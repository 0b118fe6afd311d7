"""Preprocessors: small pluggable units that turn one input file into samples.

A preprocessor is a function `fn(path, **options) -> sample | Iterator[sample]`, a sample being a
dict of field name -> NumPy array (or Python scalar). Built-ins are registered by name here; the
contract is written down in docs/preprocessors.md.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from batchctl.errors import UsageError
from batchctl.preprocess.base import (
    DESCRIBE_ATTRIBUTE,
    FILES_ATTRIBUTE,
    RAGGED_ATTRIBUTE,
    READS_ATTRIBUTE,
    Block,
    PreprocessFn,
    Preprocessor,
    Sample,
    describes,
    native,
    ragged,
    reads,
    stack_samples,
    takes,
)

__all__ = [
    "Block",
    "PreprocessFn",
    "Preprocessor",
    "Sample",
    "builtins",
    "describes",
    "native",
    "portable_name",
    "ragged",
    "reads",
    "resolve",
    "spec_of",
    "stack_samples",
    "takes",
]


PLUGIN_MODULE_PREFIX = "batchctl_plugin_"  # the module name of a plugin loaded from its file


def builtins() -> dict[str, Preprocessor]:
    from batchctl.preprocess import audio, image, npy, text

    return {p.name: p for p in (image.PREPROCESSOR, audio.PREPROCESSOR, npy.PREPROCESSOR, text.PREPROCESSOR)}


def resolve(spec: str) -> Preprocessor:
    """A built-in by name, or a user's function as `package.module:function` or `path/file.py:function`.

    Workers resolve the same spec again on their side, so a plugin never needs to be picklable.
    """
    registry = builtins()
    if spec in registry:
        return registry[spec]
    if ":" not in spec:
        raise UsageError(
            f"Expected --preprocess one of {', '.join(sorted(registry))} or module:function, got {spec!r} instead."
        )
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        where = str(Path(where).resolve())  # one name however it was typed; workers may resolve it from elsewhere
    module = _load_module(where, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"--preprocess {spec}: {where} has no function {attr!r}.")
    if not callable(fn):
        raise UsageError(f"--preprocess {spec}: {attr!r} is a {type(fn).__name__}, not a function.")
    include = tuple(getattr(fn, FILES_ATTRIBUTE, ()))
    notes = getattr(fn, DESCRIBE_ATTRIBUTE, None)  # @describes: the same whatever the options
    describe = None if notes is None else (lambda options: notes)
    return Preprocessor(
        name=f"{where}:{attr}",
        fn=fn,
        include=include,
        code=_code_of(module),
        describe=describe,
        ragged=tuple(getattr(fn, RAGGED_ATTRIBUTE, ())),
        reads=tuple(getattr(fn, READS_ATTRIBUTE, ())),
    )


def spec_of(fn: PreprocessFn) -> str:
    """The spec by which workers find a Python function again (`module:name`): a script's own
    function is `__main__:name`, which every child has, as it runs the script again."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name or "." in name:
        raise UsageError(
            f"preprocess={fn!r}: the workers import the function by its name; define it at the top level of a "
            "module or script (not a lambda, a method or a function inside another)"
        )
    if module.startswith(PLUGIN_MODULE_PREFIX):  # loaded from a file by `resolve`: the file names it
        return f"{sys.modules[module].__file__}:{name}"
    return f"{module}:{name}"


def portable_name(name: str) -> str:
    """A preprocessor's name as a dataset records it: a plugin file by its file name, not its
    path (`/home/me/x/plugins.py:fn` -> `plugins.py:fn`): the same files, options and code give
    the same dataset wherever the plugin lies, and no path of the build machine is published.
    (Its code is named by its hash beside it.)"""
    where, colon, attr = name.rpartition(":")
    return f"{Path(where).name}:{attr}" if colon and where.endswith(".py") else name


def _code_of(module: ModuleType) -> str:
    """The SHA-256 of the file a plugin's module was loaded from (the helpers it imports from
    other files are not covered: `--force` after changing those)."""
    source = getattr(module, "__file__", None)
    if not source or not Path(source).is_file():
        return f"module {module.__name__} (no file to hash)"
    return "sha256:" + hashlib.sha256(Path(source).read_bytes()).hexdigest()


def _load_module(where: str, spec: str) -> ModuleType:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"--preprocess {spec}: no such file {path}.")
        name = PLUGIN_MODULE_PREFIX + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"--preprocess {spec}: cannot load {path} as Python.")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise UsageError(f"--preprocess {spec}: importing {path} failed: {exc}") from exc
        return module
    if os.getcwd() not in sys.path:  # like `python -m`: the user's own modules are importable
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise UsageError(f"--preprocess {spec}: cannot import {where}: {exc}") from exc
