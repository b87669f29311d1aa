"""Outputs of multi-output view ops (``unbind``, ``split``, ``chunk``) keep eager's view rule.

Eager refuses to change such an output in place with grad mode on, and to use it after its
base changed in place; ``tensor_split`` (slices) is ordinary.
Every test here runs the same program eagerly and compiled and compares what happens (Note
[Multi-output views] in ``capture/analyses/aliasing.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import aot_function as pytorch_aot_function
from functorch.compile import nop

import aotgrad
from aotgrad.errors import UnsupportedOutputError
from aotgrad.signature import MultiOutputView, Output
from aotgrad.testing import verify

# Programs returning outputs of multi-output view ops, alone or with ordinary outputs.
CASES = {
    "unbind": lambda x: x.unbind(0),
    "unbind dim 1": lambda x: x.unbind(1),
    "split": lambda x: x.split(1),
    "chunk": lambda x: x.chunk(2, 1),
    "split_with_sizes": lambda x: x.split_with_sizes([1, 2], 1),
    "unbind of a view": lambda x: x.t().unbind(0),
    "view of an unbind output": lambda x: (x.unbind(0)[1].view(-1),),
    "unbind of an intermediate": lambda x: (x * 2).unbind(0),
    "intermediate and its unbind": lambda x: _with_base(x * 2),
    "mixed with ordinary outputs": lambda x: (x.unbind(0)[1], x * 2, x.view(-1), x.split(1)[0]),
    "tensor_split": lambda x: x.tensor_split(2),
}


def _with_base(y):
    return (y, *y.unbind(0))


# The caller's input: a leaf that requires grad, a non-leaf, a tensor that needs no grad.
INPUTS = {
    "leaf": lambda: torch.randn(2, 3, requires_grad=True),
    "non-leaf": lambda: torch.randn(2, 3, requires_grad=True) * 1,
    "no grad": lambda: torch.randn(2, 3),
}


def _tensors(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def _outcome(after, outs, x, k):
    """What ``after(outs, x, k)`` did: its result, or the gist of the error it raised."""
    try:
        return ("ran", after(outs, x, k))
    except RuntimeError as e:
        text = str(e)
        for gist in ("returns multiple views", "no_grad mode", "leaf Variable", "modified inplace"):
            if gist in text:
                return ("raised", gist)
        return ("raised", text)


def _compare(fn, make_input, after, compiled_fn=None):
    """Run ``fn`` eagerly and compiled on equal inputs, then ``after(outputs, x)`` on each
    output; the outcomes (and the values that ran) must be eager's."""
    compiled_fn = compiled_fn or aotgrad.aot_function(fn)
    torch.manual_seed(0)
    x = make_input()
    results = []
    for run in (fn, compiled_fn):
        xi = x.detach().clone().requires_grad_(x.requires_grad)
        xi = xi * 1 if not x.is_leaf else xi
        outs = _tensors(run(xi))
        outcomes = [_outcome(after, outs, xi, k) for k in range(len(outs))]
        results.append((outcomes, [o.detach().clone() for o in outs]))
    (eager, eager_values), (compiled, compiled_values) = results
    assert [o[0] for o in compiled] == [o[0] for o in eager]
    for (kind, e), (_, c) in zip(eager, compiled, strict=True):
        if kind == "raised":
            assert c == e
        elif isinstance(e, torch.Tensor):
            torch.testing.assert_close(c, e)
    for c, e in zip(compiled_values, eager_values, strict=True):
        torch.testing.assert_close(c, e)
    return eager


def _mul_in_place(outs, x, k):
    return outs[k].mul_(2).detach().clone()


def _mul_in_place_without_grad(outs, x, k):
    with torch.no_grad():
        return outs[k].mul_(2).detach().clone()


def _use_after_base_changed(outs, x, k):
    with torch.no_grad():
        (x._base if x._base is not None else x).add_(1)
    return (outs[k] * 3).sum().detach()


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_eager(name, inputs):
    if inputs == "no grad":
        pytest.skip("no gradient to compare")
    x = INPUTS[inputs]()
    report = verify(CASES[name], x)
    assert report.ok


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_changing_an_output_in_place_raises_as_in_eager(name, inputs):
    eager = _compare(CASES[name], INPUTS[inputs], _mul_in_place)
    if inputs != "no grad" and name != "tensor_split":
        assert ("raised", "returns multiple views") in eager  # the case tests the rule


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_changing_an_output_in_place_under_no_grad_runs_as_in_eager(name, inputs):
    eager = _compare(CASES[name], INPUTS[inputs], _mul_in_place_without_grad)
    assert all(kind == "ran" for kind, _ in eager)


@pytest.mark.parametrize("inputs", ["leaf", "non-leaf"])
@pytest.mark.parametrize("name", list(CASES))
def test_using_an_output_after_its_base_changed_raises_as_in_eager(name, inputs):
    eager = _compare(CASES[name], INPUTS[inputs], _use_after_base_changed)
    if name in ("unbind", "split", "unbind of a view", "view of an unbind output"):
        assert ("raised", "returns multiple views") in eager


def test_an_in_place_change_with_an_operand_that_requires_grad_raises_as_in_eager():
    w = torch.ones(3, requires_grad=True)

    def mul_by_w(outs, x, k):
        return outs[k].mul_(w).detach().clone()

    eager = _compare(CASES["unbind"], INPUTS["no grad"], mul_by_w)
    assert eager[0] == ("raised", "returns multiple views")


def test_a_view_of_an_input_that_needs_no_grad_takes_an_in_place_change_that_does():
    # Made with grad mode on, eager's view is an ordinary one (not a no_grad view): the
    # in-place change with an operand that requires grad runs and records its gradient.
    w = torch.randn(6, requires_grad=True)

    def mul_by_w(outs, x, k):
        w.grad = None
        outs[k].mul_(w).sum().backward()
        return w.grad.clone()

    _compare(lambda x: x.view(-1), INPUTS["no grad"], mul_by_w)


def test_views_made_under_no_grad_keep_their_own_rule():
    def f(x):
        with torch.no_grad():
            return x.unbind(0)

    eager = _compare(f, INPUTS["non-leaf"], _mul_in_place)
    assert eager[0] == ("raised", "no_grad mode")


class _Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.proj(x).unbind(0)


def _frontends():
    def compiled_function(fn):
        return aotgrad.aot_function(fn)

    def traced_then_called_again(fn):
        traced = {}

        def call(x):
            if "t" not in traced:
                traced["t"] = aotgrad.trace(fn, x)
                traced["t"](x.detach().clone().requires_grad_(x.requires_grad))
            return traced["t"](x)

        return call

    def torch_compile(fn):
        torch._dynamo.reset()
        return torch.compile(fn, backend="aotgrad", fullgraph=True)

    return {
        "aot_function": compiled_function,
        "trace then call again": traced_then_called_again,
        "torch.compile": torch_compile,
    }


@pytest.mark.parametrize("frontend", list(_frontends()))
@pytest.mark.parametrize(
    "name", ["unbind", "view of an unbind output", "unbind of an intermediate"]
)
def test_every_frontend_keeps_the_rule(name, frontend):
    fn = CASES[name]
    compiled = _frontends()[frontend](fn)
    eager = _compare(fn, INPUTS["non-leaf"], _mul_in_place, compiled_fn=compiled)
    assert ("raised", "returns multiple views") in eager
    _compare(fn, INPUTS["leaf"], _use_after_base_changed, compiled_fn=_frontends()[frontend](fn))


def test_a_module_returning_unbind_outputs_keeps_the_rule_and_its_gradients():
    torch.manual_seed(0)
    model = _Heads()
    compiled = aotgrad.aot_module(copy.deepcopy(model))
    x = torch.randn(2, 3)
    for m in (model, compiled):
        outs = m(x)
        with pytest.raises(RuntimeError, match="returns multiple views"):
            outs[0].mul_(2)
        (outs[0] * 2 + outs[1]).sum().backward()
    for p, q in zip(model.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
    assert verify(_Heads(), x).ok


def test_a_saved_and_loaded_trace_keeps_the_rule(tmp_path):
    x = torch.randn(2, 3, requires_grad=True) * 1
    aotgrad.trace(CASES["split"], x).save(tmp_path / "split.aotgrad")
    loaded = aotgrad.load(tmp_path / "split.aotgrad")
    outs = loaded(x)
    with pytest.raises(RuntimeError, match="returns multiple views"):
        outs[1].mul_(2)


def test_dynamic_shapes_keep_the_rule():
    compiled = aotgrad.aot_function(CASES["chunk"], dynamic=True)
    for rows in (2, 5):
        outs = compiled(torch.randn(rows, 4, requires_grad=True) * 1)
        with pytest.raises(RuntimeError, match="returns multiple views"):
            outs[0].mul_(2)


def test_the_signature_names_multi_output_views():
    x = torch.randn(2, 3, requires_grad=True) * 1
    traced = aotgrad.trace(CASES["mixed with ordinary outputs"], x)
    outputs = traced.signature.outputs
    assert [type(d) for d in outputs] == [MultiOutputView, Output, Output, MultiOutputView]
    assert str(outputs[0]) == "output[0] (multi-output view)"
    assert "(multi-output view)" in str(traced)


@pytest.mark.parametrize("name", ["unbind", "split", "chunk"])
def test_pytorch_aot_function_agrees_on_views_of_inputs(name):
    # PyTorch's AOTAutograd keeps the rule for views of inputs too (not of intermediates).
    for compiled in (aotgrad.aot_function(CASES[name]), pytorch_aot_function(CASES[name], nop)):
        outs = compiled(torch.randn(2, 4, requires_grad=True) * 1)
        with pytest.raises(RuntimeError, match="returns multiple views"):
            outs[0].mul_(2)


def _unbind_then_change_the_base(x):
    outs = x.unbind(0)
    x.mul_(2)
    return outs


def _no_grad_view_then_change_the_base(x):
    with torch.no_grad():
        v = x.view(-1)
    x.mul_(2)
    return v


@pytest.mark.parametrize("fn", [_unbind_then_change_the_base, _no_grad_view_then_change_the_base])
def test_a_view_whose_base_the_function_changed_is_refused_by_name(fn):
    # Eager returns it and refuses its first use; capture used to fail inside its own
    # analysis with an "op raised during capture, please report" message.
    outs = fn(torch.randn(2, 3, requires_grad=True) * 1)
    with pytest.raises(RuntimeError, match="modified inplace"):
        (outs[0] if isinstance(outs, tuple) else outs).grad_fn  # noqa: B018
    with pytest.raises(UnsupportedOutputError, match="whose base the function changed") as e:
        aotgrad.aot_function(fn)(torch.randn(2, 3, requires_grad=True) * 1)
    assert "test_multi_output_views.py" in str(e.value)


def test_a_view_whose_base_changed_is_kept_where_eager_can_still_use_it():
    # The input needs no grad: eager's views stay usable, and so do the compiled ones.
    _compare(_unbind_then_change_the_base, INPUTS["no grad"], _mul_in_place)


def test_calls_under_inference_mode_and_no_grad_each_get_their_own_rule():
    # Both modes have grad mode off and share one trace: the rebuilt views take the rule
    # of the call's own mode, as eager's do.
    compiled = aotgrad.aot_function(CASES["unbind"])
    for mode, gist in ((torch.inference_mode, "inference mode"), (torch.no_grad, "no_grad mode")):
        for run in (CASES["unbind"], compiled):
            x = torch.randn(2, 3, requires_grad=True)
            with mode():
                outs = run(x)
            with pytest.raises(RuntimeError, match=gist):
                outs[0].mul_(2)
