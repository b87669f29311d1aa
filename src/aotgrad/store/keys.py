"""Keys of the disk cache: what a trace depends on, as text that is the same in every process.

Note [Disk cache keys]
~~~~~~~~~~~~~~~~~~~~~~
An in-memory ``CacheKey`` may hold objects (a class, a function) that are equal
only within one process; the disk cache needs the same facts as stable text,
plus the code that the trace ran, which a process-local key never needed:

    what                        how it is keyed
    the function's code         the function's module and qualified name, a hash of its
                                whole code object, defaults and the code it reaches (of a
                                module: of its classes' methods) (Note [Keys of code]); and
                                every Python source file reachable from it (path, size,
                                modification time): its module, the modules of every module
                                class in the tree, and, transitively, of every function,
                                class and module their globals name
    torch, Python, aotgrad      exact versions (aotgrad's with a hash of its sources)
    the call                    every field of the ``CacheKey`` (shapes, strides, dtypes,
                                requires_grad, values read, ambient state and the torch
                                settings that choose traced ops: Note [Torch settings in
                                the key]), as text
    options                     partition, tracer, dynamic, keep_inference_input_mutations,
                                fast, the decomposition set's name, draws as inputs

Files of torch and of the standard library are covered by the versions and not
walked. Anything without a stable text is *not cached* (``Unkeyable``, with the
reason in ``cache_info``), never keyed by identity: a callable object or
``functools.partial``, a function without a source file (typed at the prompt),
module hooks, a value whose key holds a module object by address, a
``partition`` callable, custom ``decompositions``. For example::

    aot_module(model)               keyed: model's classes' files + parameter metadata
    aot_function(lambda x: x*k)     keyed when k is a number (its value is in the key)
    aot_function(partial(f, 2))     not cached: "a partial has no stable key (pass a function
                                    or a module)"
"""

from __future__ import annotations

import contextlib
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

from aotgrad._torch_compat import MODULE_HOOKS, global_module_hooks
from aotgrad.signature.closures import global_names

_MAX_MODULES = 4000
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


def function_text(fn: types.FunctionType, modules: set[str]) -> Any:
    """A function by module, qualified name and the hash of everything it runs (Note [Keys
    of code]): its code object, defaults, and the code of the functions it reaches."""
    module = fn.__module__
    if not code_is_keyable(fn.__code__) or not isinstance(module, str):
        raise Unkeyable(f"{fn.__qualname__} has no source file (or no module)")
    modules.add(module)
    digest = hashlib.sha256()
    try:
        _hash_reached(fn, digest, modules, {})
    except RecursionError:
        raise Unkeyable(f"{fn.__qualname__} reaches functions nested too deeply") from None
    return ["function", f"{module}.{fn.__qualname__}", digest.hexdigest()[:32]]


def code_is_keyable(code: types.CodeType) -> bool:
    return bool(code.co_filename) and not code.co_filename.startswith("<")


# Note [Keys of code]
# ~~~~~~~~~~~~~~~~~~~
# Two functions whose traces may differ must never share a key, even when
# their source files, names and lines are the same: ``lambda a, b: b - a`` and
# ``lambda b, a: a - b`` on one line have the same bytecode, but called as
# ``f(a=1, b=2)`` one gives 1 and the other -1; code made by ``exec`` under a
# real file's name has no text in that file at all. So a function is keyed by
# the content of its code object, not by where its text is:
#
#     code           co_code, argument counts (positional-only, keyword-only),
#                    flags, names, local and argument names (in order), free and
#                    cell variables, first line and line table, and every constant,
#                    nested code objects (lambdas, comprehensions, inner functions)
#                    hashed the same way, recursively
#     values         the defaults and keyword-only defaults, as stable text (a
#                    function whose default has none is not cached; a class's
#                    ``__init__``, which runs when a module is built, not traced,
#                    keys such a default by its type: ``field(default_factory=...)``)
#     reached code   the same hash of every function the code can call by a global
#                    name (its ``co_names`` in ``__globals__``, in nested code too)
#                    or as an attribute of a module it names (``utils.act``), of its
#                    closure's functions, and of the methods of the classes it reaches
#                    that way, transitively (torch's, aotgrad's, the standard
#                    library's and installed packages' are covered by their versions
#                    and files)
#
# The source files that define them are keyed as well (their path, size and
# modification time: Note [Disk cache keys]).
_MAX_REACHED = 2000


def _hash_reached(
    fn: types.FunctionType,
    digest: Any,
    modules: set[str],
    seen: dict[int, Any],
    building: bool = False,
) -> None:
    """Hash ``fn`` and, depth first, every function and class it reaches (Note [Keys of code]).

    ``building``: ``fn`` is a class's ``__init__``, which runs when an object is built, not
    while a module is traced: a default without a stable text is keyed by its type."""
    if id(fn) in seen:
        digest.update(b"seen %d" % list(seen).index(id(fn)))
        return
    seen[id(fn)] = fn
    if isinstance(fn.__module__, str) and code_is_keyable(fn.__code__):
        modules.add(fn.__module__)  # its file, too
    if len(seen) > _MAX_REACHED:
        raise Unkeyable(f"the code reaches more than {_MAX_REACHED} functions")
    code = fn.__code__  # with or without a file (a dataclass's __init__): by content
    digest.update(f"function {fn.__module__}.{fn.__qualname__}\n".encode())
    digest.update(code_digest(code))
    defaults = _defaults_text(fn, modules, building)
    digest.update(json.dumps(defaults, sort_keys=True).encode())
    for value in _reached_values(fn):
        if isinstance(value, types.FunctionType) and _users_code(value):
            _hash_reached(value, digest, modules, seen)
        elif isinstance(value, type) and not _skipped(value.__module__):
            _hash_class(value, digest, modules, seen)


def _users_code(fn: types.FunctionType) -> bool:
    """A function outside torch, aotgrad, the standard library and installed packages,
    whose files the versions and file stats key (Note [Keys of code])."""
    if _skipped(fn.__module__ or ""):
        return False
    filename = fn.__code__.co_filename
    return "site-packages" not in filename and not os.path.realpath(filename).startswith(_STDLIB)


def _defaults_text(fn: types.FunctionType, modules: set[str], building: bool) -> Any:
    values = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).items()]
    try:
        return stable_text([fn.__defaults__, fn.__kwdefaults__], modules)
    except Unkeyable:
        if not building:
            raise
    return [_stable_or_type(v, modules) for v in values]


def _stable_or_type(value: Any, modules: set[str]) -> Any:
    try:
        return stable_text(value, modules)
    except Unkeyable:
        return f"an object of {type(value).__module__}.{type(value).__qualname__}"


def _hash_class(cls: type, digest: Any, modules: set[str], seen: dict[int, Any]) -> None:
    """Hash the functions defined in ``cls`` and its bases outside torch (Note [Keys of code])."""
    if id(cls) in seen:
        return
    seen[id(cls)] = cls
    modules.add(cls.__module__)
    digest.update(f"class {cls.__module__}.{cls.__qualname__}\n".encode())
    for base in cls.__mro__:
        if _skipped(base.__module__):
            continue
        for name, member in sorted(vars(base).items(), key=lambda item: item[0]):
            for fn in _functions_of(member):
                if _users_code(fn):
                    digest.update(f"{base.__qualname__}.{name}\n".encode())
                    _hash_reached(fn, digest, modules, seen, building=name == "__init__")


def _functions_of(member: Any) -> list[types.FunctionType]:
    if isinstance(member, staticmethod | classmethod):
        member = member.__func__
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset) if isinstance(f, types.FunctionType)]
    return [member] if isinstance(member, types.FunctionType) else []


def _reached_values(fn: types.FunctionType) -> list[Any]:
    """The global values ``fn``'s code names, its closure's values, and the attributes its
    code names of the modules among them (``utils.act(x)``: ``utils.act``)."""
    found = []
    names = sorted(set(global_names(fn.__code__)))
    found += [fn.__globals__[n] for n in names if n in fn.__globals__]
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            found.append(cell.cell_contents)
    for module in [v for v in found if isinstance(v, types.ModuleType)]:
        if not _skipped(module.__name__):
            found += [vars(module)[n] for n in names if n in vars(module)]
    return found


def code_digest(code: types.CodeType) -> bytes:
    """A hash of everything in ``code`` that decides what it does (Note [Keys of code])."""
    digest = hashlib.sha256()
    _hash_code(code, digest)
    return digest.digest()


def _hash_code(code: types.CodeType, digest: Any) -> None:
    digest.update(code.co_code)
    fields = [
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_nlocals,
        code.co_firstlineno,
        code.co_name,
        list(code.co_names),
        list(code.co_varnames),
        list(code.co_freevars),
        list(code.co_cellvars),
        code.co_linetable.hex(),
        len(code.co_consts),
    ]
    digest.update(json.dumps(fields).encode())
    for const in code.co_consts:
        _hash_const(const, digest)


def _hash_const(const: Any, digest: Any) -> None:
    """A constant by type and value: ``1``, ``1.0``, ``True`` and ``-0.0`` all differ; a
    frozenset in an order independent of the hash seed."""
    if isinstance(const, types.CodeType):
        digest.update(b"code(")
        _hash_code(const, digest)
        digest.update(b")")
    elif isinstance(const, tuple | frozenset):
        items = list(const)
        if isinstance(const, frozenset):
            items.sort(key=lambda c: (type(c).__name__, repr(c)))
        digest.update(f"{type(const).__name__}({len(items)}:".encode())
        for item in items:
            _hash_const(item, digest)
        digest.update(b")")
    elif isinstance(const, float | complex):
        text = const.hex() if isinstance(const, float) else f"{const.real.hex()},{const.imag.hex()}"
        digest.update(f"{type(const).__name__}:{text};".encode())
    else:  # None, bool, int, str, bytes, Ellipsis
        text = repr(const)
        digest.update(f"{type(const).__name__}:{len(text)}:{text};".encode())


def module_code(module: torch.nn.Module, modules: set[str]) -> list[str]:
    """The classes of ``module``'s tree (it runs their code); hooks make it unkeyable."""
    if any(global_module_hooks(h) for h in MODULE_HOOKS):
        raise Unkeyable("global module hooks are registered")
    classes = []
    for name, sub in module.named_modules(remove_duplicate=False):
        if any(getattr(sub, h) for h in MODULE_HOOKS):
            raise Unkeyable(f"module {name or type(sub).__name__} has hooks")
        if "forward" in vars(sub):
            raise Unkeyable(
                f"module {name or type(sub).__name__} has a forward set on the instance"
            )
        classes.append(f"{name}: {stable_text(type(sub), modules)}")
    digest = hashlib.sha256()
    seen: dict[int, Any] = {}
    for sub in module.modules():
        if not _skipped(type(sub).__module__):
            try:
                _hash_class(type(sub), digest, modules, seen)
            except RecursionError:
                raise Unkeyable(f"{type(sub).__name__} reaches code nested too deeply") from None
    return [*classes, f"code {digest.hexdigest()[:32]}"]


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
