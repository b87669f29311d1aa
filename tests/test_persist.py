"""Traced.save / aotgrad.load and the disk cache (docs/caching.md)."""

from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import types
from typing import NamedTuple

import pytest
import torch

import aotgrad
from aotgrad.errors import CallError, StoreError
from aotgrad.store.format import FORMAT_VERSION
from models import GPT

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(a, b):
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name)


# -- save / load ------------------------------------------------------------------------


def test_save_load_gpt_round_trip(tmp_path):
    torch.manual_seed(0)
    model = GPT()
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    path = tmp_path / "gpt.aotgrad"
    aotgrad.trace(model, idx, targets).save(path)
    eager, loaded_model = copy.deepcopy(model), copy.deepcopy(model)
    loaded = aotgrad.load(path, module=loaded_model)
    expected = eager(idx, targets)
    got = loaded(idx, targets)
    torch.testing.assert_close(got, expected)
    expected.backward()
    got.backward()
    _assert_same_grads(eager, loaded_model)
    assert [str(d) for d in loaded.signature.forward_inputs][:2] == [
        "param tok.weight",
        "param pos.weight",
    ]
    assert loaded.saved and all(s.module is not None for s in loaded.saved)


def test_save_load_keeps_what_mincut_recomputes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    traced = aotgrad.trace(model, torch.randn(4, 8), partition="mincut")
    traced.save(tmp_path / "mincut.aotgrad")
    loaded = aotgrad.load(tmp_path / "mincut.aotgrad", module=model)
    assert loaded.recomputed == traced.partitioned.recomputed
    assert loaded.saved == traced.saved


def test_save_load_batchnorm_updates_the_modules_buffers(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True)
    )
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "convbn.aotgrad"
    aotgrad.trace(copy.deepcopy(model), x).save(path)
    eager, loaded_model = copy.deepcopy(model), copy.deepcopy(model)
    loaded = aotgrad.load(path, module=loaded_model)
    for _ in range(2):  # twice: the second call reads the buffers the first one updated
        expected, got = eager(x), loaded(x)
        torch.testing.assert_close(got, expected)
        expected.sum().backward()
        got.sum().backward()
    _assert_same_grads(eager, loaded_model)
    for name, buffer in eager.named_buffers():
        torch.testing.assert_close(loaded_model.get_buffer(name), buffer, msg=name)
    assert int(loaded_model[1].num_batches_tracked) == 2


def test_load_provenance_and_graph_text(tmp_path):
    def f(x, w):
        return (x @ w).sin()

    traced = aotgrad.trace(f, torch.ones(2, 3), torch.ones(3, 4, requires_grad=True))
    traced.save(tmp_path / "f.aotgrad")
    loaded = aotgrad.load(tmp_path / "f.aotgrad")
    assert loaded.signature == traced.signature
    assert loaded.saved == traced.saved
    seq = [n.meta["aotgrad"].seq_nr for n in loaded.forward.graph.nodes if n.op == "call_function"]
    assert seq == [
        n.meta["aotgrad"].seq_nr for n in traced.forward.graph.nodes if n.op == "call_function"
    ]
    assert "aten.mm.default" in loaded.forward.code


def test_load_refuses_wrong_calls(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "lin.aotgrad"
    aotgrad.trace(model, torch.ones(4, 3)).save(path)
    with pytest.raises(CallError, match="module=model"):
        aotgrad.load(path)
    loaded = aotgrad.load(path, module=torch.nn.Linear(3, 2))
    with pytest.raises(CallError, match=r"shape \(4, 3\) != \(5, 3\)"):
        loaded(torch.ones(5, 3))
    with pytest.raises(CallError, match="lacks a tensor"):
        aotgrad.load(path, module=torch.nn.Sequential())(torch.ones(4, 3))


def test_save_refuses_closed_over_tensors(tmp_path):
    w = torch.ones(3, requires_grad=True)
    traced = aotgrad.trace(lambda x: x * w, torch.ones(3))
    with pytest.raises(StoreError, match="pass that tensor as an argument"):
        traced.save(tmp_path / "closure.aotgrad")


def _rewrite(path, edit, fix_checksum=True):
    """Edit the payload of a graph file (and, as a careful attacker would, its checksum).

    ``edit(header, run, about)`` changes the three lines' data in place.
    """
    import hashlib

    head, run, about = path.read_bytes().split(b"\n")
    header, run, about = json.loads(head), json.loads(run), json.loads(about)
    edit(header, run, about)
    payload = json.dumps(run).encode() + b"\n" + json.dumps(about).encode()
    if fix_checksum:
        header["bytes"], header["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


def _first_op(run):
    return next(n for n in run["forward"]["nodes"] if n[1] == "call_function")


def _set(item, index, value):
    item[index] = value


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda h, r, a: _set(r["forward"]["targets"], 0, "os.system"),
            "unknown target 'os.system'",
        ),
        (
            lambda h, r, a: _set(r["forward"]["targets"], 0, "builtins.eval.x"),
            "not a registered torch operator overload",
        ),
        (lambda h, r, a: _set(_first_op(r), 2, 99), "malformed target 99"),
        (
            lambda h, r, a: _set(_first_op(r), 3, {"tuple": [{"node": "nowhere"}]}),
            "refers to 'nowhere', not defined before it",
        ),
        (lambda h, r, a: _set(_first_op(r), 0, "x; import os"), "is not a Python identifier"),
        (lambda h, r, a: _set(_first_op(r), 0, "__import__"), "keyword or builtin name"),
        (lambda h, r, a: _set(_first_op(r), 0, "x"), "defined twice"),
        (
            lambda h, r, a: _set(_first_op(r), 4, {"x=__import__('os').getpid()) or (1": 1}),
            "has a keyword argument",
        ),
        (lambda h, r, a: r["plan"].update(type="Popen"), "unknown stored type 'Popen'"),
        (
            lambda h, r, a: r["plan"]["fields"].update(returned={"tuple": [99]}),
            "names forward outputs",
        ),
        (lambda h, r, a: a["signature"].update(type="Popen"), "unknown stored type 'Popen'"),
        (lambda h, r, a: a["forward"]["values"].pop(), "does not match its nodes"),
        (lambda h, r, a: h.update(torch="1.0.0"), "written by torch 1.0.0"),
        (lambda h, r, a: h.update(version=FORMAT_VERSION + 1), "written by version"),
    ],
)
def test_load_of_a_tampered_file_raises(tmp_path, edit, message):
    path = tmp_path / "f.aotgrad"
    aotgrad.trace(lambda x: x.sin() * 2, torch.ones(3, requires_grad=True)).save(path)
    _rewrite(path, edit)
    with pytest.raises(StoreError, match=message):
        aotgrad.load(path)


def test_load_of_a_truncated_or_edited_file_raises(tmp_path):
    path = tmp_path / "f.aotgrad"
    aotgrad.trace(lambda x: x.sin() * 2, torch.ones(3, requires_grad=True)).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match="cut short"):
        aotgrad.load(path)
    path.write_bytes(data.replace(b'"mul"', b'"mux"', 1))
    with pytest.raises(StoreError, match="checksum mismatch"):
        aotgrad.load(path)
    path.write_bytes(data[:10])
    with pytest.raises(StoreError, match="not an aotgrad graph file"):
        aotgrad.load(path)


# -- the disk cache, in one process ---------------------------------------------------------


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x)).relu()


def _entries(directory):
    return sorted(directory.glob("*/*.aotgrad"))


def test_second_aot_module_loads_from_disk(cache_dir):
    torch.manual_seed(0)
    model, x = Small(), torch.randn(3, 4)
    first = aotgrad.aot_module(copy.deepcopy(model))
    first(x).sum().backward()
    assert (aotgrad.cache_info(first).disk_hits, aotgrad.cache_info(first).disk_misses) == (0, 1)
    assert len(_entries(cache_dir)) == 1
    copy_ = copy.deepcopy(model)
    second = aotgrad.aot_module(copy_)
    second(x).sum().backward()
    info = aotgrad.cache_info(second)
    assert (info.disk_hits, info.disk_misses, info.disk_skipped) == (1, 0, None)
    _assert_same_grads(first.orig_module, copy_)
    assert "disk: 1 hits, 0 misses" in str(info)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "version"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(cache_dir, damage):
    x = torch.randn(3, 4)
    aotgrad.aot_module(Small())(x)
    (entry,) = _entries(cache_dir)
    good = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(good[:-100])
    elif damage == "garbage":
        entry.write_bytes(b"\x00" * 64)
    else:
        _rewrite(entry, lambda h, r, a: h.update(aotgrad="0.0.0+old"))
    model = Small()
    again = aotgrad.aot_module(model)
    torch.testing.assert_close(again(x), model(x))
    info = aotgrad.cache_info(again)
    assert (info.disk_hits, info.disk_misses) == (0, 1)
    assert aotgrad.store.loads(entry.read_bytes()) is not None  # rewritten whole


def test_what_is_not_cached_says_why(cache_dir, monkeypatch):
    def f(x, scale):
        return x * scale

    g = aotgrad.aot_function(functools.partial(f, scale=2.0))
    g(torch.ones(2))
    assert "partial has no stable key" in aotgrad.cache_info(g).disk_skipped
    h = aotgrad.aot_function(lambda x: x.cos(), disk_cache=False)
    h(torch.ones(2))
    assert aotgrad.cache_info(h).disk_skipped == "disk_cache=False"
    monkeypatch.setenv("AOTGRAD_CACHE", "0")
    k = aotgrad.aot_function(lambda x: x.cos())
    k(torch.ones(2))
    assert aotgrad.cache_info(k).disk_skipped == "AOTGRAD_CACHE=0"
    assert not _entries(cache_dir)


def test_a_global_value_is_part_of_the_key(cache_dir, monkeypatch):
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    first = aotgrad.aot_function(_scaled)
    assert first(torch.ones(2)).tolist() == [2.0, 2.0]
    monkeypatch.setitem(globals(), "SCALE", 3.0)
    second = aotgrad.aot_function(_scaled)
    assert second(torch.ones(2)).tolist() == [3.0, 3.0]
    assert aotgrad.cache_info(second).disk_hits == 0
    assert len(_entries(cache_dir)) == 2


SCALE = 2.0


def _scaled(x):
    return x * SCALE


def test_least_recently_used_entries_are_evicted(cache_dir, monkeypatch):
    f = aotgrad.aot_function(_scaled)
    f(torch.ones(2))
    (size,) = {p.stat().st_size for p in _entries(cache_dir)}
    monkeypatch.setenv("AOTGRAD_CACHE_SIZE_MB", str(2.5 * size / 2**20))
    f(torch.ones(3))
    oldest = {p.name for p in _entries(cache_dir)}
    aotgrad.aot_function(_scaled)(torch.ones(2))  # a hit: now the most recent
    f(torch.ones(4))
    kept = {p.name for p in _entries(cache_dir)}
    assert len(kept) == 2 and len(oldest & kept) == 1


# -- across processes ------------------------------------------------------------------


SCRIPT = """
import json, sys, torch, aotgrad, aotgrad.pipeline as pipeline
sys.path.insert(0, {tests!r})
from models import GPT

captures = []
original = pipeline.capture_and_partition
pipeline.capture_and_partition = lambda *a, **kw: captures.append(1) or original(*a, **kw)
import aotgrad.runtime.straight_line as straight
sources = []
source_of = straight.straight_line_source
straight.straight_line_source = lambda g: sources.append(source_of(g)[0]) or source_of(g)
torch.manual_seed(0)
model = GPT()
idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
if sys.argv[1] == "compile":
    compiled = torch.compile(model, backend="aotgrad")
    info = None
else:
    compiled = aotgrad.aot_module(model)
loss = compiled(idx, targets)
loss.backward()
info = None if sys.argv[1] == "compile" else aotgrad.cache_info(compiled)
print(json.dumps({{
    "loss": loss.item(),
    "grads": {{n: p.grad.tolist() for n, p in model.named_parameters() if p.grad is not None}},
    "captures": len(captures),
    "sources": sources,
    "disk_hits": None if info is None else info.disk_hits,
}}))
"""


def _run(script, directory, *args):
    env = {**os.environ, "AOTGRAD_CACHE": "1", "AOTGRAD_CACHE_DIR": str(directory)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("frontend", ["aot_module", "compile"])
def test_a_fresh_process_loads_from_disk_and_matches(tmp_path, frontend):
    script = tmp_path / "run_gpt.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(ROOT / "tests"))))
    first = _result(_run(script, tmp_path / "cache", frontend))
    second = _result(_run(script, tmp_path / "cache", frontend))
    assert first["captures"] == 1 and second["captures"] == 0
    if frontend == "aot_module":
        assert second["disk_hits"] == 1
    # The code the second process runs is the code of the graphs the first one traced
    # (Note [Graphs read from a file]).
    assert len(second["sources"]) == 2 and second["sources"] == first["sources"]
    assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)
    assert second["grads"].keys() == first["grads"].keys()
    for name, grad in first["grads"].items():
        torch.testing.assert_close(torch.tensor(second["grads"][name]), torch.tensor(grad))


def test_two_processes_writing_one_key_both_succeed(tmp_path):
    script = tmp_path / "run_gpt.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(ROOT / "tests"))))
    a, b = (_run(script, tmp_path / "cache", "aot_module") for _ in range(2))
    results = [_result(a), _result(b)]
    assert results[0]["loss"] == results[1]["loss"]
    (entry,) = _entries(tmp_path / "cache")
    assert aotgrad.store.loads(entry.read_bytes()) is not None
    assert not list((tmp_path / "cache").glob("*/*.tmp"))
    third = _result(_run(script, tmp_path / "cache", "aot_module"))
    assert (third["captures"], third["disk_hits"]) == (0, 1)


def _mutates(x, y):
    x.add_(1)
    return x * y, y.view(-1)


def test_disk_hit_keeps_mutations_and_aliases(cache_dir):
    for expected_hits in (0, 1):
        f = aotgrad.aot_function(_mutates)
        x, y = torch.zeros(2, 2), torch.ones(2, 2, requires_grad=True)
        out, view = f(x, y)
        assert x.tolist() == [[1.0, 1.0], [1.0, 1.0]]
        assert view._base is y and out.requires_grad
        assert aotgrad.cache_info(f).disk_hits == expected_hits


def test_save_load_inference_graph(tmp_path):
    path = tmp_path / "inference.aotgrad"
    aotgrad.trace(lambda x, n: x.cos() * n, torch.ones(3), 2).save(path)
    loaded = aotgrad.load(path)
    assert loaded.backward is None
    torch.testing.assert_close(loaded(torch.zeros(3), 2), torch.full((3,), 2.0))
    with pytest.raises(CallError, match="hold 2 as a constant"):
        loaded(torch.zeros(3), 3)
    with pytest.raises(CallError, match="hold 2 as a constant"):
        loaded(torch.zeros(3), 2.0)  # equal, but another type: the graph may differ


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _pair(p):
    return Pair(p.a.sin(), p.b * 2)


def test_what_a_file_cannot_hold_is_traced_not_cached(cache_dir, tmp_path):
    args = Pair(torch.ones(2, requires_grad=True), torch.ones(2))
    with pytest.raises(StoreError, match="cannot store the structure"):
        aotgrad.trace(_pair, args).save(tmp_path / "pair.aotgrad")
    f = aotgrad.aot_function(_pair)
    assert f(args).b.tolist() == [2.0, 2.0]
    assert "cannot store the structure" in aotgrad.cache_info(f).disk_skipped
    assert not _entries(cache_dir)


# -- graphs read from a file are the graphs written (Note [Graphs read from a file]) -------


def test_loaded_graphs_are_the_traced_graphs(tmp_path):
    from aotgrad.runtime.straight_line import straight_line_source
    from aotgrad.store.format import stored_value

    torch.manual_seed(0)
    model = GPT()
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    traced = aotgrad.trace(model, idx, targets, partition="mincut")
    traced.save(tmp_path / "gpt.aotgrad")
    read = aotgrad.store.loads((tmp_path / "gpt.aotgrad").read_bytes(), lazy=True)
    loaded = aotgrad.load(tmp_path / "gpt.aotgrad", module=model)
    for got, steps, expected in (
        (loaded.forward, read.forward.steps, traced.forward),
        (loaded.backward, read.backward.steps, traced.backward),
    ):
        assert got.code == expected.code
        assert straight_line_source(steps)[0] == straight_line_source(expected)[0]
        for a, b in zip(got.graph.nodes, expected.graph.nodes, strict=True):
            assert (a.name, a.op, a.target) == (b.name, b.op, b.target)
            assert a.meta.get("aotgrad") == b.meta.get("aotgrad"), a.name
            value = b.meta.get("val")
            if isinstance(value, torch.Tensor):
                size, stride, offset, dtype, device, _ = stored_value(a)
                assert (tuple(size), tuple(stride), offset, dtype, device) == (
                    tuple(value.shape),
                    value.stride(),
                    value.storage_offset(),
                    value.dtype,
                    value.device,
                )
    assert loaded.recomputed == traced.partitioned.recomputed


def test_a_disk_hit_gives_a_users_compiler_the_traced_graphs(cache_dir):
    seen = []

    def compiler(gm, examples):
        seen.append((gm.code, [(tuple(e.shape), e.dtype) for e in examples]))
        return gm

    x = torch.randn(3, 4)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Small()
        compiled = aotgrad.aot_module(model, fw_compiler=compiler)
        out = compiled(x)
        out.sum().backward()
        runs.append((out, _grads(model), aotgrad.cache_info(compiled).disk_hits))
    assert [hits for _, _, hits in runs] == [0, 1]
    assert len(seen) == 4 and seen[:2] == seen[2:]
    torch.testing.assert_close(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1])


def _tamper_entry(directory, edit):
    (entry,) = _entries(directory)
    _rewrite(entry, edit)
    return entry


@pytest.mark.parametrize(
    "edit",
    [
        lambda h, r, a: _set(r["forward"]["targets"], 0, "os.system"),
        lambda h, r, a: _set(_first_op(r), 3, {"tuple": [{"node": "nowhere"}]}),
        lambda h, r, a: h.update(version=FORMAT_VERSION - 1),
        lambda h, r, a: r["plan"]["fields"].update(returned={"tuple": [99]}),
    ],
)
def test_a_tampered_or_old_entry_is_a_miss_and_is_rewritten(cache_dir, edit):
    x = torch.randn(3, 4)
    aotgrad.aot_module(Small())(x)
    entry = _tamper_entry(cache_dir, edit)
    model = Small()
    again = aotgrad.aot_module(model)
    torch.testing.assert_close(again(x), model(x))
    assert (aotgrad.cache_info(again).disk_hits, aotgrad.cache_info(again).disk_misses) == (0, 1)
    assert aotgrad.store.loads(entry.read_bytes()) is not None  # rewritten whole


def test_a_bad_description_is_a_miss_for_a_users_compiler(cache_dir):
    """A user's compiler gets the fx graphs, built from the description: a bad one is a miss."""
    x = torch.randn(3, 4)
    aotgrad.aot_module(Small())(x)
    model = Small()
    _tamper_entry(cache_dir, lambda h, r, a: a["signature"].update(type="Popen"))
    compiled = aotgrad.aot_module(model, fw_compiler=lambda gm, _: gm)
    torch.testing.assert_close(compiled(x), model(x))
    assert aotgrad.cache_info(compiled).disk_misses == 1


def test_a_bad_description_is_read_at_the_first_create_graph_backward(cache_dir):
    """A nop hit with a backward runs from the run line; the description (signature, fx
    graphs) is read when the create_graph backward first needs it, and a bad one raises
    StoreError there, running nothing from the file."""
    x = torch.randn(3, 4, requires_grad=True)
    aotgrad.aot_module(Small())(x)
    model = Small()
    _tamper_entry(cache_dir, lambda h, r, a: a["signature"].update(type="Popen"))
    compiled = aotgrad.aot_module(model)
    out = compiled(x)
    assert aotgrad.cache_info(compiled).disk_hits == 1
    (g,) = torch.autograd.grad(out.sum(), x)  # first order: no description needed
    torch.testing.assert_close(g, torch.autograd.grad(model(x).sum(), x)[0])
    with pytest.raises(aotgrad.StoreError):
        torch.autograd.grad(compiled(x).sum(), x, create_graph=True)


def test_an_inference_hit_reads_no_description(cache_dir):
    """Without a backward, a nop hit runs from the checked run line alone (Note [Graphs
    read from a file]): the description, unused, is not read."""
    x = torch.randn(3, 4)
    aotgrad.aot_function(_scaled)(x)
    _tamper_entry(cache_dir, lambda h, r, a: a["signature"].update(type="Popen"))
    again = aotgrad.aot_function(_scaled)
    torch.testing.assert_close(again(x), x * SCALE)
    assert aotgrad.cache_info(again).disk_hits == 1


def test_dynamo_graph_keys_tell_graphs_apart():
    from aotgrad.dynamo import graph_key

    def key(fn):
        return graph_key(torch.fx.symbolic_trace(fn))[0]

    assert key(lambda x: x[1:, ...] * 2) == key(lambda x: x[1:, ...] * 2)
    assert key(lambda x: x[1:] * 2) != key(lambda x: x[2:] * 2)
    assert key(lambda x: x * 2) != key(lambda x: x * 2.0)
    assert key(lambda x: x.view((2, 3))) != key(lambda x: x.view([2, 3]))
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.mul, (graph.placeholder("x"), object())))
    unkeyable = types.SimpleNamespace(graph=graph)  # (an fx module could not print it)
    assert graph_key(unkeyable) is None  # the object has no stable text


def test_an_input_named_in_capitals_loads_under_its_name(tmp_path):
    # ``fx.Graph.placeholder("W1")`` names the node ``w1``: a file's graph was refused on load
    # (found through a disk hit followed by a create_graph backward, which reads the graph).
    def net(x, W1):
        return torch.tanh(x @ W1)

    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    traced = aotgrad.trace(net, x, w)
    traced.save(tmp_path / "net.aotgrad")
    loaded = aotgrad.load(tmp_path / "net.aotgrad")
    for got, expected in ((loaded.forward, traced.forward), (loaded.backward, traced.backward)):
        pairs = zip(got.graph.nodes, expected.graph.nodes, strict=True)
        assert all((a.name, a.op, a.target) == (b.name, b.op, b.target) for a, b in pairs)
    (g,) = torch.autograd.grad(loaded(x, w).sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(net(x, w).sum(), x, create_graph=True)
    torch.testing.assert_close(g, expected)
    g.sum().backward()


def test_traced_and_loaded_show_one_view_of_the_trace(tmp_path):
    """``Traced`` and ``Loaded`` answer from one ``TraceView``: the same graphs, signature,
    saved and recomputed values, and the same printed text."""
    from aotgrad.store.loaded import TraceView

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    traced = aotgrad.trace(model, torch.randn(3, 4), partition="mincut")
    traced.save(tmp_path / "mlp.aotgrad")
    loaded = aotgrad.load(tmp_path / "mlp.aotgrad", module=model)
    assert isinstance(traced, TraceView) and isinstance(loaded, TraceView)
    assert traced.recomputed and loaded.recomputed == traced.recomputed
    assert loaded.saved == traced.saved and loaded.signature == traced.signature
    assert loaded.forward.code == traced.forward.code
    assert loaded.backward is not None and traced.backward is not None
    assert loaded.backward.code == traced.backward.code
    assert str(loaded) == str(traced) and "# backward" in str(traced)
