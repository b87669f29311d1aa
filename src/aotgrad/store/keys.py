"""Keys of the disk cache: what a trace depends on, as text that is the same in every process.

Note [Disk cache keys]
~~~~~~~~~~~~~~~~~~~~~~
An in-memory ``CacheKey`` may hold objects (a class, a function) that are equal
only within one process; the disk cache needs the same facts as stable text,
plus the code that the trace ran, which a process-local key never needed:

    what                        how it is keyed
    the function's code         the function's module and qualified name, its first line, a
                                hash of its bytecode; and every Python source file reachable
                                from it (path, size, modification time): its module, the
                                modules of every module class in the tree, and, transitively,
                                of every function, class and module their globals name
    torch, Python, aotgrad      exact versions (aotgrad's with a hash of its sources)
    the call                    every field of the ``CacheKey`` (shapes, strides, dtypes,
                                requires_grad, values read, ambient state), as text
    options                     partition, tracer, dynamic, keep_inference_input_mutations

Files of torch and of the standard library are covered by the versions and not
walked. Anything without a stable text is *not cached* (``Unkeyable``, with the
reason in ``cache_info``), never keyed by identity: a callable object or
``functools.partial``, a function without a source file (typed at the prompt),
module hooks, a value whose key holds a module object by address, a
``partition`` callable, custom ``decompositions``. For example::

    aot_module(model)               keyed: model's classes' files + parameter metadata
    aot_function(lambda x: x*k)     keyed when k is a number (its value is in the key)
    aot_function(partial(f, 2))     not cached: "a functools.partial has no stable key"
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

_MAX_MODULES = 4000
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_SKIPPED_PREFIXES = ("torch", "aotgrad", "functorch", "builtins")
_STDLIB = tuple(os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib"))


class Unkeyable(Exception):
    """A trace the disk cache has no stable key for; the message says why."""


def stable_text(value: Any, modules: set[str]) -> Any:
    """``value`` as JSON data equal across processes; the modules it names go into ``modules``.

    >>> stable_text((int, 3, torch.float32, torch.Size([2])), set())
    ['type builtins.int', 3, 'torch.float32', ['size', 2]]
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return ["float", value.hex()]
    if isinstance(value, torch.Size):
        return ["size", *value]
    if isinstance(value, tuple | list):
        if _by_address(value):
            raise Unkeyable("a value the function reads is keyed by its address in memory")
        return [stable_text(v, modules) for v in value]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    return _stable_object(value, modules)


def _by_address(key: tuple[Any, ...] | list[Any]) -> bool:
    """A value key holding an address (Note [Keys of Python values]): a module argument,
    a cycle, a weak reference's referent. Equal only within one process."""
    if len(key) == 3 and (key[0] == "module" or key[1] == "cycle"):
        return True
    return len(key) == 2 and key[0] == "referent"


def _stable_object(value: Any, modules: set[str]) -> Any:
    if isinstance(value, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return str(value)
    if isinstance(value, pytree.TreeSpec):
        return ["treespec", str(value)]
    if isinstance(value, enum.Enum):
        return ["enum", _stable_object(type(value), modules), str(value.value)]
    if isinstance(value, type):
        modules.add(value.__module__)
        return f"type {value.__module__}.{value.__qualname__}"
    if isinstance(value, types.FunctionType):
        return function_text(value, modules)
    if isinstance(value, types.BuiltinFunctionType) and value.__module__:
        return f"builtin {value.__module__}.{value.__qualname__}"
    if isinstance(value, types.ModuleType):
        modules.add(value.__name__)
        return f"module {value.__name__}"
    if isinstance(value, dict):
        return [
            "dict",
            *([stable_text(k, modules), stable_text(v, modules)] for k, v in value.items()),
        ]
    raise Unkeyable(f"a {type(value).__qualname__} has no stable key")


def function_text(fn: types.FunctionType, modules: set[str]) -> str:
    """A function by module, qualified name, first line and a hash of its bytecode."""
    code = fn.__code__
    if not code.co_filename or code.co_filename.startswith("<"):
        raise Unkeyable(f"{fn.__qualname__} has no source file")
    modules.add(fn.__module__)
    digest = hashlib.sha256(_code_bytes(code)).hexdigest()[:16]
    return f"function {fn.__module__}.{fn.__qualname__}:{code.co_firstlineno}:{digest}"


def _code_bytes(code: types.CodeType) -> bytes:
    parts = [code.co_code, repr(code.co_names).encode()]
    for const in code.co_consts:
        parts.append(
            _code_bytes(const) if isinstance(const, types.CodeType) else repr(const).encode()
        )
    return b"".join(parts)


def module_code(module: torch.nn.Module, modules: set[str]) -> list[str]:
    """The classes of ``module``'s tree (it runs their code); hooks make it unkeyable."""
    if any(getattr(torch.nn.modules.module, f"_global{h}") for h in _HOOKS):
        raise Unkeyable("global module hooks are registered")
    classes = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if any(getattr(sub, h) for h in _HOOKS):
            raise Unkeyable(f"module {name or type(sub).__name__} has hooks")
        if "forward" in vars(sub):
            raise Unkeyable(
                f"module {name or type(sub).__name__} has a forward set on the instance"
            )
        classes.append(f"{name}: {stable_text(type(sub), modules)}")
    return classes


def source_files(roots: Iterable[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of every source file reachable from the modules ``roots``."""
    seen: set[str] = set()
    stack = [name for name in roots if not _skipped(name)]
    files = []
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if len(seen) > _MAX_MODULES:
            raise Unkeyable(f"the code reaches more than {_MAX_MODULES} modules")
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if module is None or path is None:
            if name in sys.builtin_module_names:
                continue
            raise Unkeyable(f"module {name} has no source file")
        real = os.path.realpath(path)
        if real.startswith(_STDLIB) and "site-packages" not in real:
            continue  # covered by the Python version
        stat = os.stat(real)
        files.append((real, stat.st_size, stat.st_mtime_ns))
        stack.extend(_names_reached(module, seen))
    return sorted(files)


def _skipped(name: str) -> bool:
    return name.split(".")[0] in _SKIPPED_PREFIXES


def _names_reached(module: types.ModuleType, seen: set[str]) -> list[str]:
    found = []
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            name = value.__name__
        elif isinstance(value, type | types.FunctionType):
            name = getattr(value, "__module__", None) or ""
        else:
            continue
        if name and name not in seen and not _skipped(name):
            found.append(name)
    return found


def digest(parts: dict[str, Any]) -> str:
    """The hex key of ``parts`` (JSON data)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
