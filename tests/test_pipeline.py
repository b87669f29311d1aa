"""One stage driver (``aotgrad.pipeline``); the frontends take ``Options``' keywords once;
``fast=False`` captures with the full trace only (issue 27)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import pytest
import torch

import aotgrad
from aotgrad.cli import main
from aotgrad.compilers import nop
from aotgrad.errors import ConfigError
from aotgrad.settings import Options

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "aotgrad"
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "carry.py"
FIELDS = [f.name for f in dataclasses.fields(Options)]
FRONTENDS = {
    "aot_function": aotgrad.aot_function,
    "aot_module": aotgrad.aot_module,
    "backend": aotgrad.backend,
    "scan": aotgrad.scan,
    "scan_function": aotgrad.scan_function,
    "scan_layers": aotgrad.scan_layers,
}


def _calls(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            names.add(node.func.id)
    return names


def test_the_stage_sequence_is_written_once():
    """Only the pipeline calls the stages' entry functions (the create_graph backward and
    aotgrad.load reach them through it)."""
    stages = {"capture", "partition", "compile_partitioned", "desugar", "check_joint"}
    callers = {
        str(path.relative_to(SRC)): sorted(_calls(path) & stages)
        for path in SRC.rglob("*.py")
        if not path.is_relative_to(SRC / "capture") and not path.is_relative_to(SRC / "partition")
    }
    assert {k: v for k, v in callers.items() if v} == {
        "pipeline.py": ["capture", "check_joint", "compile_partitioned", "desugar", "partition"]
    }


@pytest.mark.parametrize("name", list(FRONTENDS))
def test_an_unknown_keyword_is_named_with_the_valid_ones(name):
    f = FRONTENDS[name]
    args = {
        "aot_module": (torch.nn.Linear(2, 2),),
        "scan": (lambda c, x: (c, x), torch.ones(2), torch.ones(3, 2)),
        "scan_layers": ([torch.nn.Linear(2, 2)], torch.ones(2)),
    }.get(name, (lambda x: x,) if name != "backend" else ())
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'dynamc'") as e:
        f(*args, dynamc=True)
    assert ", ".join(FIELDS) in str(e.value)


@pytest.mark.parametrize("name", list(FRONTENDS))
def test_signatures_show_the_options(name):
    parameters = inspect.signature(FRONTENDS[name]).parameters
    assert set(FIELDS) <= set(parameters)
    assert parameters["fast"].default is None  # AOTGRAD_FAST's
    assert parameters["cache_limit"].default == 8
    assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def test_every_earlier_call_still_works():
    calls = []

    def counting(gm, examples):  # type: ignore[no-untyped-def]
        calls.append(gm)
        return gm

    f = aotgrad.aot_function(
        lambda x, b: (x.sin() * 2, b.add_(1)),
        counting,
        counting,
        partition_fn=lambda node: True,  # a policy: save every value
        decompositions={},
        inference_compiler=counting,
        keep_inference_input_mutations=True,
        partition="save_all",
        cache_limit=2,
        dynamic=False,
        tracer="auto",
        disk_cache=False,
    )
    x, b = torch.ones(3, requires_grad=True), torch.zeros(2)
    f(x, b)[0].sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.ones(3).cos())
    assert len(calls) == 2 and b.tolist() == [1.0, 1.0]
    model = aotgrad.aot_module(torch.nn.Linear(2, 2), nop, nop, cache_limit=1)
    assert model(torch.ones(1, 2)).shape == (1, 2)


def test_fast_reads_the_environment(monkeypatch):
    monkeypatch.delenv("AOTGRAD_FAST", raising=False)
    assert Options().fast
    monkeypatch.setenv("AOTGRAD_FAST", "0")
    assert not Options().fast
    assert Options(fast=True).fast  # the keyword wins
    assert not aotgrad.aot_function(lambda x: x, fast=None)._options.fast  # None: the variable's
    assert not Options(fast=None).fast and Options(fast=None, check=None).check is False  # type: ignore[arg-type]
    monkeypatch.setenv("AOTGRAD_FAST", "maybe")
    with pytest.raises(ConfigError, match="AOTGRAD_FAST='maybe' is neither on nor off"):
        Options()


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return torch.tanh(self.fc(x)).sum(dim=-1)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.fast_path  # compares the default (fast) with fast=False
def test_fast_false_captures_with_the_full_trace_and_matches_eager(monkeypatch):
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(2, 4)
    assert aotgrad.trace(model, x).tracer == "direct"
    assert aotgrad.trace(model, x, fast=False).tracer == "full"
    model(x).sum().backward()
    eager, expected = _grads(model), model(x)
    model.zero_grad()
    compiled = aotgrad.aot_module(model, fast=False)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(_grads(model), eager, strict=True):
        torch.testing.assert_close(got, want)
    assert compiled.compiled.partitioned.joint.tracer.name == "full"
    monkeypatch.setenv("AOTGRAD_FAST", "0")
    f = aotgrad.aot_function(lambda x: x.cos())
    torch.testing.assert_close(f(x), x.cos())
    assert f.partitioned.joint.tracer.name == "full"


def test_the_direct_tracer_is_refused_without_the_fast_path():
    with pytest.raises(ValueError, match="tracer='direct' needs the fast path"):
        aotgrad.trace(lambda x: x.sin(), torch.ones(2), tracer="direct", fast=False)
    with pytest.raises(ValueError, match="tracer='direct' needs the fast path"):
        aotgrad.aot_function(lambda x: x, tracer="direct", fast=False)


def test_the_create_graph_backward_keeps_fast_false(monkeypatch):
    """``G`` is captured under the first order's options, the fast path off included."""
    tracers = []
    original = aotgrad.pipeline.capture_stage

    def recorded(traceable, options, on_joint=None):  # type: ignore[no-untyped-def]
        joint = original(traceable, options, on_joint)
        tracers.append(joint.tracer.name)
        return joint

    monkeypatch.setattr(aotgrad.pipeline, "capture_stage", recorded)
    x = torch.randn(3, requires_grad=True)
    f = aotgrad.aot_function(lambda x: (x.sin() * x).sum(), fast=False)
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (g_eager,) = torch.autograd.grad((x.sin() * x).sum(), x, create_graph=True)
    torch.testing.assert_close(gg, torch.autograd.grad(g_eager.sum(), x)[0])
    assert tracers == ["full", "full"]


def _sin(x):  # type: ignore[no-untyped-def]
    return x.sin()


@pytest.mark.fast_path  # compares the default (fast) with fast=False
def test_fast_is_in_the_disk_cache_key(cache_dir):
    x = torch.randn(3, requires_grad=True)
    aotgrad.aot_function(_sin)(x)
    off = aotgrad.aot_function(_sin, fast=False)
    torch.testing.assert_close(off(x), x.sin())
    assert aotgrad.cache_info(off).disk_hits == 0
    assert off.partitioned is not None and off.partitioned.joint.tracer.name == "full"
    again = aotgrad.aot_function(_sin, fast=False)
    again(x)
    assert aotgrad.cache_info(again).disk_hits == 1


@pytest.mark.fast_path  # compares the default (fast) with fast=False
def test_the_cli_takes_no_fast_and_check(capsys, monkeypatch):
    checked = []
    original = aotgrad.pipeline.check_joint
    monkeypatch.setattr(aotgrad.pipeline, "check_joint", lambda j: checked.append(original(j)))
    assert main(["show", f"{EXAMPLE}:fn", "--no-check", "--no-fast", "--check"]) == 0
    out = capsys.readouterr().out
    assert "=== tracer ===\nfull" in out and checked
    assert main(["show", f"{EXAMPLE}:fn", "--no-check"]) == 0
    assert "=== tracer ===\ndirect" in capsys.readouterr().out and len(checked) == 1
