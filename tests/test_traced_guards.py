"""A ``Traced`` (and graphs from ``aotgrad.load``) runs only calls of its capture's
specialization (Note [A Traced keeps to its capture]): any other is a ``CallError`` naming the
input and the difference, and nothing runs; a call of the same specialization matches eager."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch

import aotgrad
from aotgrad.errors import CallError


def f(x, w, scale=1.0):
    return (x @ w).reshape(-1) / x.shape[0] * scale


def _args():
    return torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda x, w: (torch.randn(5, 4), w), r"input x: shape \(3, 4\) != \(5, 4\)"),
        (lambda x, w: (x.double(), w), "input x: dtype torch.float32 != torch.float64"),
        (lambda x, w: (x.to("meta"), w), "input x: device cpu != meta"),
        (lambda x, w: (x, w.detach()), "input w: requires_grad True != False"),
        (lambda x, w: (torch.randn(4, 3).t(), w), r"input x: stride \(4, 1\) != \(1, 3\)"),
        (lambda x, w: (x, x.t().contiguous()), r"input w: shape \(4, 5\) != \(4, 3\)"),
    ],
)
def test_a_call_of_another_specialization_is_refused_naming_the_input(make, said):
    x, w = _args()
    traced = aotgrad.trace(f, x, w)
    args = make(x, w)
    with pytest.raises(CallError, match=said) as e:
        traced(*args)
    assert "aotgrad.aot_function" in str(e.value) and "TreeSpec" not in str(e.value)


def test_the_message_shows_both_tensors():
    x, w = _args()
    traced = aotgrad.trace(f, x, w)
    with pytest.raises(CallError, match=r"captured float32\[3, 4\], got float64\[5, 4\]"):
        traced(torch.randn(5, 4, dtype=torch.float64), w)


def test_a_call_of_the_capture_specialization_matches_eager():
    x, w = _args()
    traced = aotgrad.trace(f, x, w)
    for _ in range(3):  # the second call on takes the last entry's fast path
        x, w = _args()
        out = traced(x, w)
        out.sum().backward()
        expected_w = w.detach().clone().requires_grad_()
        expected = f(x, expected_w)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(w.grad, expected_w.grad)


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda t, x, w: t(x), r"argument w is missing \(the capture passed float32\[4, 5\]"),
        (lambda t, x, w: t(x, w, 2.0), r"argument scale \(2.0\) was not passed at capture"),
        (lambda t, x, w: t(x, w, z=1), r"argument z \(1\) was not passed at capture"),
        (lambda t, x, w: t([x], w), r"argument x is structured otherwise"),
    ],
)
def test_a_missing_or_extra_argument_is_named(call, said):
    x, w = _args()
    traced = aotgrad.trace(f, x, w)
    with pytest.raises(CallError, match=said) as e:
        call(traced, x, w)
    assert "TreeSpec" not in str(e.value)


def test_an_argument_by_keyword_is_the_same_call():
    x, w = _args()
    traced = aotgrad.trace(f, x, w, scale=3.0)
    for out in (traced(x, w, scale=3.0), traced(x, w=w, scale=3.0), traced(w=w, x=x, scale=3.0)):
        torch.testing.assert_close(out, f(x, w, scale=3.0))
    with pytest.raises(CallError, match=r"value 3.0 != 2.0"):
        traced(x, w, scale=2.0)  # a number the graphs hold


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Dropout(0.0), torch.nn.Linear(6, 2)
    )


def _step_eager(model, x):
    out = model(x)
    out.sum().backward()
    return out


def _assert_same_step(traced_call, model, x):
    """One step through ``traced_call`` and eagerly on a copy: outputs, every parameter's
    gradient, every buffer after the call."""
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    out = traced_call(x)
    out.sum().backward()
    expected = _step_eager(twin, x)
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(model.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, c, msg=name)


def test_a_traced_module_runs_its_specialization_and_refuses_eval():
    model = _model()
    traced = aotgrad.trace(model, torch.randn(8, 4))
    for _ in range(2):
        _assert_same_step(traced, model, torch.randn(8, 4))
    model.eval()  # BatchNorm would read, not update, its running statistics
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(CallError, match=r"train\(\) and eval\(\).*self.training") as e:
        traced(torch.randn(8, 4))
    assert "self.training: value True != False" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), before, strict=True))


def test_a_traced_module_refuses_its_parameters_in_another_dtype():
    model = _model()
    traced = aotgrad.trace(model, torch.randn(8, 4))
    model.double()
    with pytest.raises(CallError, match=r"param 0.weight: dtype torch.float32 != torch.float64"):
        traced(torch.randn(8, 4))


def test_a_replaced_parameter_is_read_at_the_call():
    model = _model()
    traced = aotgrad.trace(model, torch.randn(8, 4))
    model[3].weight = torch.nn.Parameter(torch.randn(2, 6))  # same metadata, new tensor
    _assert_same_step(traced, model, torch.randn(8, 4))


NET = _model()
K = 2.0


def loss_over_global(x):
    return NET(x).square().mean() * K


def test_a_function_over_a_global_module():
    global K
    traced = aotgrad.trace(loss_over_global, torch.randn(8, 4))
    x = torch.randn(8, 4)
    twin = copy.deepcopy(NET)
    out = traced(x)
    out.backward()
    expected = twin(x).square().mean() * K
    expected.backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(NET.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    for b, c in zip(NET.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, c)
    NET.eval()
    try:
        with pytest.raises(CallError, match=r"global NET.training: value True != False"):
            traced(x)
    finally:
        NET.train()
    K = 3.0
    try:
        with pytest.raises(CallError, match=r"global K: value 2.0 != 3.0"):
            traced(x)
    finally:
        K = 2.0
    traced(x)  # back to the capture's flags and values: runs


def test_another_grad_mode_is_refused():
    x, w = _args()
    traced = aotgrad.trace(f, x, w)
    with torch.no_grad(), pytest.raises(CallError, match="grad mode True != False"):
        traced(x, w)


def test_a_dynamic_capture_serves_other_sizes_within_its_guards():
    x, w = _args()
    traced = aotgrad.trace(f, x, w, dynamic=True)
    for rows in (5, 7):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(traced(x, w), f(x, w))
    with pytest.raises(CallError, match=r"input w: dtype"):
        traced(x, w.double())


def test_loaded_graphs_keep_to_the_capture(tmp_path: pathlib.Path):
    model = _model()
    path = tmp_path / "model.aotgrad"
    aotgrad.trace(model, torch.randn(8, 4)).save(path)
    loaded = aotgrad.load(path, module=model)
    _assert_same_step(loaded, model, torch.randn(8, 4))
    _assert_same_step(lambda x: loaded(input=x), model, torch.randn(8, 4))
    with pytest.raises(CallError, match=r"input: shape \(8, 4\) != \(5, 4\)"):
        loaded(torch.randn(5, 4))
    with pytest.raises(CallError, match=r"argument input is missing"):
        loaded()
    with pytest.raises(CallError, match=r"positional argument #1 \(2\) was not passed"):
        loaded(torch.randn(8, 4), 2)
    model.eval()
    with pytest.raises(CallError, match=r"self.training: True at capture, False now"):
        loaded(torch.randn(8, 4))


def test_a_traced_called_by_code_being_captured_is_traced_through():
    traced = aotgrad.trace(lambda x: x.sin(), torch.ones(3, requires_grad=True))
    outer = aotgrad.aot_function(lambda x: traced(x) * 2, disk_cache=False)
    x = torch.randn(5, requires_grad=True)  # another shape: the capture sees the function
    out = outer(x)
    out.sum().backward()
    expected = x.detach().clone().requires_grad_()
    (expected.sin() * 2).sum().backward()
    torch.testing.assert_close(out, x.sin() * 2)
    torch.testing.assert_close(x.grad, expected.grad)


def test_a_submodule_switched_to_eval_is_refused():
    model = _model()
    traced = aotgrad.trace(model, torch.randn(8, 4))
    model[1].eval()  # the BatchNorm alone
    with pytest.raises(CallError, match=r"self.1.training: value True != False"):
        traced(torch.randn(8, 4))
    model[1].train()
    _assert_same_step(traced, model, torch.randn(8, 4))


def test_dimensions_marked_dynamic_stay_dynamic_for_unmarked_calls():
    x, w = _args()
    traced = aotgrad.trace(f, aotgrad.dynamic(x, 0), w)
    for rows in (3, 6):
        x = torch.randn(rows, 4)  # not marked: the capture's marks count
        torch.testing.assert_close(traced(x, w), f(x, w))
    with pytest.raises(CallError, match=r"shape guard .*x.size\(\)\[0\] failed"):
        traced(torch.randn(1, 4), w)  # a size the capture's guards exclude
    with pytest.raises(CallError, match=r"input x: shape \(\*, 4\) != \(\*, 5\)"):
        traced(torch.randn(3, 5), w)


def test_a_positional_call_of_a_keyword_capture_keeps_the_arguments_apart():
    def g(x, w):
        return x * 2 + w

    a, b = torch.randn(3), torch.randn(3)
    traced = aotgrad.trace(g, w=b, x=a)  # captured by keyword, w first
    for _ in range(3):  # the fast path must not take (x, w) for the capture's (w, x)
        x, w = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(traced(x, w), g(x, w))
