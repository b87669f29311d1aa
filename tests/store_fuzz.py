"""The crafted-file fuzzer: mutated graph files and cache entries, read by aotgrad.

Starts from real files (``Traced.save`` of a few small functions and modules, and a disk
cache entry), mutates their JSON with ``hypothesis`` (targets swapped for other registered
ops, dangerous ones among them; tree structures naming modules and types; names and
descriptors with line breaks and code; deep nesting; huge sizes; values of the wrong type),
and reads each one as ``aotgrad.load`` and a disk-cache hit do. Every outcome must be:

- a ``StoreError`` (or, calling a loaded file, one of aotgrad's own errors), or a load
  whose graphs then run, and give the original's results when the mutation changed nothing;
- never code run (no sentinel module imported, no sentinel global set), no file written
  (a watched folder, where every path the fuzzer plants points), no raw exception.

A loaded graph whose ops are allowed may still be a wrong graph (the file's writer chose
it): running it may raise what its kernels raise on these inputs, as eager would (a shape
mismatch: an error whose innermost frame is the graph's call of a kernel), and its results
are compared only for mutations that change nothing.

``tests/test_store_fuzz.py`` runs a bounded, deterministic slice in ``make test``;
``python tests/store_fuzz.py --examples 5000`` runs a longer one.
"""

from __future__ import annotations

import argparse
import builtins
import copy
import functools
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aotgrad
from aotgrad.errors import AotgradError, StoreError
from aotgrad.pipeline import differentiable_backward_driver
from aotgrad.settings import Options
from aotgrad.store.disk import DiskCache
from aotgrad.store.persist import EntryKey, load_graphs
from store_fuzz_entry import entry_fn

# Modules whose import would mean a file ran code: planted in every place a name can go.
SENTINEL_MODULES = ("tabnanny", "this", "unittest.__main__")
SENTINEL_GLOBAL = "AOTGRAD_FUZZ_PWNED"
WATCHED = pathlib.Path(tempfile.mkdtemp(prefix="aotgrad-store-fuzz-"))
PLANTED = str(WATCHED / "planted.bin")

_CODE = [
    f"__import__('builtins').{SENTINEL_GLOBAL}=1",
    f"x\n):\n    pass\n__import__('builtins').{SENTINEL_GLOBAL}=1\nif (1",
    f"x\r__import__('builtins').{SENTINEL_GLOBAL}=1",
    f"x\u2028__import__('builtins').{SENTINEL_GLOBAL}=1\x85",
    "x'\"\\",
    "",
    "import tabnanny",
    PLANTED,
]
STRINGS = st.sampled_from(
    [
        *_CODE,
        *SENTINEL_MODULES,
        "tabnanny:x",
        "tabnanny.check",
        "os.system",
        "builtins.eval",
        "__import__",
        "self",
        "forward",
        "args",
        "torch",
        "x",
        "sin",
        "output",
        "placeholder",
        "call_function",
        "get_attr",
        "call_module",
        "float32",
        "cpu",
        "meta",
        "Input",
        "Popen",
        "Plan",
        "builtins.tuple",
        "collections.defaultdict",
    ]
) | st.text(max_size=12)

# Targets a file may name: the seeds' own, other real ops, dangerous ones, non-ops.
TARGETS = [
    "aten.mm.default",
    "aten.add.Tensor",
    "aten.mul.Tensor",
    "aten.sin.default",
    "aten.cos.default",
    "aten.view.default",
    "aten.t.default",
    "aten.sum.default",
    "aten.sum.dim_IntList",
    "aten.expand.default",
    "aten.as_strided.default",
    "aten.empty.memory_format",
    "aten.full.default",
    "aten.index_select.default",
    "aten._local_scalar_dense.default",
    "aten.copy_.default",
    "aten.add_.Tensor",
    "aten.mm.out",
    "aten.from_file.default",
    "aten._print.default",
    "aten.set_.source_Storage",
    "aten.resize_.default",
    "aten._copy_from.default",
    "aten.uniform_.default",
    "aten._assert_async.msg",
    "prims.copy_to.default",
    "prims.convert_element_type.default",
    "profiler._record_function_enter.default",
    "_c10d_functional.all_reduce.default",
    "operator.getitem",
    "os.system",
    "builtins.eval",
    "aten.mm",
    "aten..default",
    "aten.__class__.default",
    "tabnanny.check.default",
]

_SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 3, 2**31, 2**63, 10**30, -(10**30)])
    | st.sampled_from([0.5, 1e308, float("inf")]).map(lambda f: f if f != float("inf") else 1e309)
    | STRINGS
)
_TAGGED_KEYS = [
    "node",
    "tuple",
    "slice",
    "device",
    "dtype",
    "layout",
    "memory_format",
    "float",
    "enum",
    "type",
    "fields",
    "structure",
    "treespec",
    "value",
]


def _tagged(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.dictionaries(st.sampled_from(_TAGGED_KEYS), children, min_size=1, max_size=2)


JSON_VALUES = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=3) | _tagged(c), max_leaves=8)


def _nested(depth: int, leaf: str) -> str:
    return "[" * depth + leaf + "]" * depth


# -- seeds: real files ------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    name: str
    data: bytes
    module: torch.nn.Module | None
    args: tuple[Any, ...]
    expected: Any


def _fn_seed(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def _tree_seed(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"a": d["x"] @ d["w"], "b": (d["x"].cos(), [d["w"].sum()])}


@functools.cache
def seeds() -> tuple[Seed, ...]:
    torch.manual_seed(0)
    made = []
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    cases = [
        ("fn", _fn_seed, None, (torch.randn(3, requires_grad=True),)),
        (
            "tree",
            _tree_seed,
            None,
            ({"x": torch.randn(2, 3), "w": torch.randn(3, 2, requires_grad=True)},),
        ),
        ("module", model, model, (torch.randn(5, 3),)),
        ("inference", _fn_seed, None, (torch.randn(4),)),
    ]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="aotgrad-store-seeds-"))
    for name, fn, module, args in cases:
        path = folder / f"{name}.aotgrad"
        aotgrad.trace(fn, *args).save(path)
        made.append(Seed(name, path.read_bytes(), module, args, _values(fn(*args))))
    made.append(_cache_seed(folder))
    return tuple(made)


def _cache_seed(folder: pathlib.Path) -> Seed:
    directory = folder / "cache"
    saved = {k: os.environ.get(k) for k in ("AOTGRAD_CACHE", "AOTGRAD_CACHE_DIR")}
    os.environ.update(AOTGRAD_CACHE="1", AOTGRAD_CACHE_DIR=str(directory))
    try:
        x = torch.randn(3, requires_grad=True)
        aotgrad.aot_function(entry_fn)(x)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    (entry,) = directory.glob("*/*.aotgrad")
    return Seed("entry", entry.read_bytes(), None, (x,), _values(entry_fn(x)))


def _values(result: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, result
    )


# -- mutations --------------------------------------------------------------------------------


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``data`` a value sits, outermost first."""
    found = [prefix]
    if isinstance(data, dict):
        for key in data:
            found += _paths(data[key], (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _paths(value, (*prefix, i))
    return found


def _get_at(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def _set(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    *head, last = path
    holder = data
    for key in head:
        holder = holder[key]
    holder[last] = value
    return data


@st.composite
def mutations(draw: st.DrawFn, lines: list[Any]) -> tuple[str, list[Any], bytes | None]:
    """(what was done, the three lines mutated, raw payload bytes to splice in or None)."""
    lines = copy.deepcopy(lines)
    kind = draw(
        st.sampled_from(
            ["none", "target", "value", "number", "name", "structure", "deep", "size", "text"]
        )
    )
    _, run, about = lines
    if kind == "none":
        return kind, lines, None
    if kind == "target":
        graph = run[draw(st.sampled_from([k for k in ("forward", "backward") if run[k]]))]
        i = draw(st.integers(0, len(graph["targets"]) - 1))
        graph["targets"][i] = draw(st.sampled_from(TARGETS))
        return kind, lines, None
    if kind == "name":
        graph = run[draw(st.sampled_from([k for k in ("forward", "backward") if run[k]]))]
        node = draw(st.sampled_from(graph["nodes"]))
        node[0] = draw(STRINGS)
        return kind, lines, None
    if kind == "structure":
        evil = draw(
            st.sampled_from(
                [
                    ["named", {"type": "tabnanny.Fly", "context": None}, []],
                    ["tabnanny", None, [None]],
                    ["defaultdict", ["tabnanny.check", []], []],
                    ["return_types", "__loader__", []],
                    ["dict", ["a", "a"], [None, None]],
                    json.dumps([1, {"type": "collections.defaultdict", "context": "x"}]),
                ]
            )
            | JSON_VALUES
        )
        if "spec" in run["call"] and draw(st.booleans()):
            run["call"]["spec"] = evil
        else:
            run["plan"]["fields"]["out_spec"] = {
                draw(st.sampled_from(["structure", "treespec"])): evil
            }
        return kind, lines, None
    if kind == "deep":
        depth = draw(st.sampled_from([50, 600, 3000, 50_000]))
        which = draw(st.sampled_from(["call", "plan", "nodes", "about"]))
        marker = "__DEEP__"
        if which == "call":
            run["call"][draw(st.sampled_from(["constants", "spec", "positions", "autocast"]))] = (
                marker
            )
        elif which == "plan":
            run["plan"]["fields"]["returned"] = marker
        elif which == "nodes":
            node = draw(st.sampled_from(run["forward"]["nodes"]))
            node[3] = marker
        else:
            about["signature"] = marker
        leaf = draw(st.sampled_from(["0", '{"tuple": []}', '{"node": "x"}']))
        return kind, lines, _nested(depth, leaf).encode()
    if kind == "size":
        values = about["forward"]["values"]
        i = draw(st.integers(0, len(values) - 1))
        huge = draw(st.sampled_from([2**40, 2**63 - 1, 2**64, -1, 10**30]))
        about["forward"]["values"][i] = [
            [huge, huge],
            [1, huge],
            0,
            {"dtype": "float32"},
            {"device": "cpu"},
            False,
        ]
        return kind, lines, None
    if kind == "text":
        payload = draw(st.sampled_from(_CODE))
        text = json.dumps(about)
        for field in ('"path": "', '"name": "'):
            text = text.replace(field, field + json.dumps(payload)[1:-1], 1)
        lines[2] = json.loads(text)
        return kind, lines, None
    if kind == "number":  # an int anywhere (positions, counts, sizes) made another int
        which = draw(st.sampled_from([1, 2]))
        places = [p for p in _paths(lines[which]) if type(_get_at(lines[which], p)) is int]
        if places:
            value = draw(st.sampled_from([0, 1, -1, 2, 7, 2**31, 2**63, -(2**63)]))
            _set(lines[which], draw(st.sampled_from(places)), value)
        return kind, lines, None
    # "value": any value anywhere in the run or about line
    which = draw(st.sampled_from([1, 2]))
    places = _paths(lines[which])
    path = draw(st.sampled_from(places[1:]))
    _set(lines[which], path, draw(JSON_VALUES))
    return kind, lines, None


def encoded(lines: list[Any], raw: bytes | None) -> bytes:
    """The file for ``lines``, its length and checksum fixed as a careful attacker would."""
    header, run, about = lines
    payload = json.dumps(run).encode() + b"\n" + json.dumps(about).encode()
    if raw is not None:
        payload = payload.replace(b'"__DEEP__"', raw, 1)
    header = dict(header, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return json.dumps(header).encode() + b"\n" + payload


# -- the check --------------------------------------------------------------------------------


class Violation(AssertionError):
    pass


def _watched() -> list[str]:
    return sorted(os.listdir(WATCHED))


def _check_nothing_ran(before_files: list[str]) -> None:
    ran = [m for m in SENTINEL_MODULES if m in sys.modules]
    if ran:
        raise Violation(f"a file imported {ran}")
    if hasattr(builtins, SENTINEL_GLOBAL):
        raise Violation("a file ran code: the sentinel global is set")
    if _watched() != before_files:
        raise Violation(f"a file wrote {set(_watched()) - set(before_files)}")


def check(seed: Seed, kind: str, data: bytes) -> str:
    """Read ``data`` as ``seed`` is read; the outcome, or a :class:`Violation`."""
    for m in SENTINEL_MODULES:
        sys.modules.pop(m, None)
    before = _watched()
    try:
        outcome = _read_and_run(seed, kind, data)
    except Violation:
        raise
    except SystemExit as e:
        raise Violation(f"a file made the process exit ({e})") from e
    _check_nothing_ran(before)
    return outcome


def _read_and_run(seed: Seed, kind: str, data: bytes) -> str:
    path = WATCHED / f"{seed.name}.aotgrad"
    path.write_bytes(data)
    try:
        if seed.name == "entry":
            return _read_entry(seed, kind, path)
        try:
            loaded = aotgrad.load(path, module=seed.module)
            loaded.forward.code  # noqa: B018  (generating the code must run nothing)
            if loaded.backward is not None:
                loaded.backward.code  # noqa: B018
        except StoreError:
            return "refused"
        except Exception as e:
            raise Violation(f"load raised {type(e).__name__}: {e}") from e
        return _run(seed, kind, loaded)
    finally:
        path.unlink()


def _read_entry(seed: Seed, kind: str, path: pathlib.Path) -> str:
    """As a disk-cache hit reads an entry, for ``nop`` and for a user's compiler: a miss
    (None), or graphs that run."""
    cache = DiskCache(directory=WATCHED / "cache", max_bytes=2**30)
    key = "00" + hashlib.sha256(path.read_bytes()).hexdigest()
    target = cache.path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(path.read_bytes())
    outcome = "miss"
    try:
        for compiler in (None, _users_compiler):
            try:
                options = Options(fw_compiler=compiler, bw_compiler=compiler, disk_cache=False)
                found = load_graphs(
                    EntryKey(cache=cache, key=key), options, differentiable_backward_driver(options)
                )
            except StoreError:
                continue
            except Exception as e:
                raise Violation(f"a cache read raised {type(e).__name__}: {e}") from e
            if found is not None:
                compiled = found[0]
                outcome = _run(seed, kind, lambda *args: compiled(list(args)))  # noqa: B023
    finally:
        target.unlink()
        target.parent.rmdir()
        (WATCHED / "cache").rmdir()
    return outcome


def _users_compiler(gm: torch.fx.GraphModule, examples: Any) -> Any:
    return gm.forward


def _run(seed: Seed, kind: str, fn: Any) -> str:
    args = copy.deepcopy(seed.args)
    try:
        result = fn(*args)
    except AotgradError:
        return "refused at the call"
    except Exception as e:
        if kind == "none" or not _raised_by_a_kernel(e):
            raise Violation(f"a loaded file's call raised {type(e).__name__}: {e}") from e
        return "its kernels raised"  # a wrong graph, allowed to run; see the module docstring
    if kind == "none":
        torch.testing.assert_close(_values(result), seed.expected)
    return "ran"


def _raised_by_a_kernel(e: BaseException) -> bool:
    """Did ``e`` come out of an op's kernel, called by the graph's code (not aotgrad's own)?"""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and (
        frames[-1].filename.startswith(("<aotgrad straight-line", "<eval_with_key>"))
        or frames[-1].filename.endswith(os.path.join("torch", "_ops.py"))
    )


# -- entry points -----------------------------------------------------------------------------


def _lines(seed: Seed) -> list[Any]:
    return [json.loads(line) for line in seed.data.split(b"\n")]


@st.composite
def cases(draw: st.DrawFn) -> tuple[Seed, str, bytes]:
    seed = draw(st.sampled_from(seeds()))
    kind, lines, raw = draw(mutations(_lines(seed)))
    return seed, kind, encoded(lines, raw)


def fuzz(examples: int, seed: int | None = None) -> None:
    @settings(
        max_examples=examples,
        derandomize=seed is None,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def run(case: tuple[Seed, str, bytes]) -> None:
        check(*case)

    run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    args = parser.parse_args(argv)
    fuzz(args.examples)
    print(f"{args.examples} crafted files: every one refused, a miss, or run as checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
