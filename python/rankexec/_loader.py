"""Loads rank components named `"module:Class"` or `"path/to/file.py:Class"`.

`args` become keyword arguments of the class. A relative `file.py` is resolved against
the current directory (the executor starts ranks in the host's directory).

Only classes are loaded: a path naming a function or any other callable
(`os:system`, `subprocess:call`) raises `NotAClass` before anything is called, so a
component's config names a class and its arguments, never a call with arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["NotAClass", "build", "check", "resolve"]


class NotAClass(TypeError):
    """A component path names something that is not a class (`path`, `kind`)."""

    def __init__(self, path: str, obj: object) -> None:
        self.path = path
        self.kind = type(obj).__name__
        super().__init__(
            f"component path {path!r} names a {self.kind}, not a class: a component must be a class"
        )


def _module(spec: str) -> ModuleType:
    if spec.endswith(".py"):
        path = os.path.abspath(spec)
        name = "_rankexec_user_" + os.path.splitext(os.path.basename(path))[0]
        if name in sys.modules:
            return sys.modules[name]
        if not os.path.isfile(path):
            raise ImportError(f"no such file: {path}")
        loc = importlib.util.spec_from_file_location(name, path)
        if loc is None or loc.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(loc)
        sys.modules[name] = module
        # Imports next to the file work, as they do for `python file.py`.
        sys.path.insert(0, os.path.dirname(path))
        try:
            loc.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    return importlib.import_module(spec)


def resolve(path: str) -> type:
    """The class named by `path` (`module:Class` or `file.py:Class`)."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"component path {path!r} is not 'module:Class' or 'file.py:Class'")
    module = _module(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{module_name} has no attribute {attr!r}") from None
    if not inspect.isclass(obj):
        raise NotAClass(path, obj)
    return obj


def _kwargs(args_json: str) -> dict[str, Any]:
    args = json.loads(args_json)
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise TypeError(f"component args must be a JSON object, got {type(args).__name__}")
    return args


def check(component_id: str, path: str, args_json: str) -> None:
    """Raises if `path` cannot be imported or does not accept `args`; builds nothing."""
    cls = resolve(path)
    kwargs = _kwargs(args_json)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise TypeError(f"component {component_id!r} ({path}): {e}") from None
    except ValueError:
        pass  # no signature to check (a builtin): building will tell


def build(component_id: str, path: str, args_json: str) -> Any:
    """Builds the component: `Class(**args)`."""
    del component_id
    return resolve(path)(**_kwargs(args_json))
