"""What a capture specializes on is guarded: a changed value re-traces, never runs a stale graph."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import aotgrad

SCALE = 2


def test_a_module_attribute_read_in_forward_is_guarded():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = 2.0

        def forward(self, x):
            return self.lin(x) * self.scale

    model = Scaled()
    compiled = aotgrad.aot_module(model)
    x = torch.randn(3, 2)
    torch.testing.assert_close(compiled(x), model(x))
    model.scale = 3.0
    torch.testing.assert_close(compiled(x), model(x))
    assert aotgrad.cache_info(compiled).reasons[-1] == "closure self.scale: value 2.0 != 3.0"


def test_an_attribute_of_a_closed_over_submodule_is_guarded():
    act = nn.Hardtanh(-1.0, 1.0)
    compiled = aotgrad.aot_function(lambda x: act(x))
    x = torch.linspace(-3, 3, 7)
    compiled(x)
    act.max_val = 2.0
    torch.testing.assert_close(compiled(x), act(x))


def test_a_global_int_read_by_the_function_is_guarded():
    global SCALE
    compiled = aotgrad.aot_function(lambda x: x * SCALE)
    try:
        torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 2.0))
        SCALE = 3
        torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 3.0))
        assert aotgrad.cache_info(compiled).reasons[-1] == "global SCALE: value 2 != 3"
    finally:
        SCALE = 2


def test_a_closure_variable_read_by_a_helper_is_guarded():
    def make():
        factor = 2.0

        def f(x):
            return x * factor

        def set_factor(v):
            nonlocal factor
            factor = v

        return f, set_factor

    f, set_factor = make()
    compiled = aotgrad.aot_function(f)
    compiled(torch.ones(2))
    set_factor(5.0)
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 5.0))


def test_a_global_slice_is_keyed_by_its_bounds():
    # Slices are unhashable before Python 3.12: the key holds their bounds instead.
    namespace = {"S": slice(0, 2)}
    exec("def f(x):\n    return x[S] * 2", namespace)
    compiled = aotgrad.aot_function(namespace["f"])
    torch.testing.assert_close(compiled(torch.arange(3.0)), torch.tensor([0.0, 2.0]))
    namespace["S"] = slice(1, None)
    torch.testing.assert_close(compiled(torch.arange(3.0)), torch.tensor([2.0, 4.0]))
    assert aotgrad.cache_info(compiled).misses == 2


def test_a_mutable_argument_is_keyed_by_value_not_identity():
    class Config:
        def __init__(self):
            self.scale = 2.0

    cfg = Config()
    compiled = aotgrad.aot_function(lambda x, c: x * c.scale)
    x = torch.ones(2)
    compiled(x, cfg)
    cfg.scale = 3.0
    torch.testing.assert_close(compiled(x, cfg), x * 3)
    other = Config()
    other.scale = 3.0
    compiled(x, other)
    assert aotgrad.cache_info(compiled).hits == 1, "equal values share an entry"


@pytest.mark.parametrize(
    ("first", "second"),
    [(0.0, -0.0), (1, True), (1, 1.0), (0, False)],
)
def test_python_values_equal_to_python_but_not_to_a_graph_are_distinct(first, second):
    compiled = aotgrad.aot_function(lambda x, s: (x / s, type(s).__name__))
    x = torch.ones(1)
    assert compiled(x, first)[1] == type(first).__name__
    out, kind = compiled(x, second)
    assert kind == type(second).__name__
    torch.testing.assert_close(out, x / second if second else x / torch.tensor(float(second)))


def test_nan_hits_its_own_entry():
    compiled = aotgrad.aot_function(lambda x, s: x + s)
    compiled(torch.ones(1), float("nan"))
    compiled(torch.ones(1), float("nan"))
    assert aotgrad.cache_info(compiled).misses == 1


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float


def test_a_dataclass_argument_is_flattened_into_its_fields():
    compiled = aotgrad.aot_function(lambda b: (b.x * b.scale).sum())
    a = torch.randn(2000, requires_grad=True)
    b = torch.randn(2000, requires_grad=True)
    torch.testing.assert_close(compiled(Batch(a, 2.0)), (a * 2).sum())
    out = compiled(Batch(b, 2.0))
    torch.testing.assert_close(out, (b * 2).sum())
    out.backward()
    torch.testing.assert_close(b.grad, torch.full((2000,), 2.0))
    traced = aotgrad.trace(lambda b: b.x * b.scale, Batch(a, 3.0))
    assert [str(d) for d in traced.signature.forward_inputs] == ["b.x"]


def test_an_object_argument_holding_a_tensor_is_refused_with_its_type():
    class Holder:
        def __init__(self, t):
            self.t = t

    compiled = aotgrad.aot_function(lambda h: h.t.sum())
    with pytest.raises(aotgrad.CallError, match="Holder holds a tensor"):
        compiled(Holder(torch.ones(2, requires_grad=True)))


def test_a_module_argument_is_lifted_and_keyed_by_identity():
    # Note [Module arguments]; more in test_closures.py
    compiled = aotgrad.aot_function(lambda x, m: m(x))
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    for m in (first, second, first):
        torch.testing.assert_close(compiled(torch.ones(1, 2), m), m(torch.ones(1, 2)))
    info = aotgrad.cache_info(compiled)
    assert (info.misses, info.hits) == (2, 1)


def test_a_buffer_added_after_the_first_call_is_lifted():
    model = nn.Linear(2, 2)
    compiled = aotgrad.aot_module(model)
    x = torch.ones(1, 2)
    compiled(x)
    model.register_buffer("offset", torch.full((2,), 5.0))
    model.forward = lambda x: nn.functional.linear(x, model.weight, model.bias) + model.offset
    compiled = aotgrad.aot_module(model)
    torch.testing.assert_close(compiled(x), model(x))

    model = nn.Linear(2, 2)
    compiled = aotgrad.aot_module(model)
    compiled(x)
    model.register_buffer("extra", torch.ones(2))
    torch.testing.assert_close(compiled(x), model(x))
    assert "added ['buffer extra']" in aotgrad.cache_info(compiled).reasons[-1]


def test_a_value_the_function_changes_itself_is_not_guarded():
    calls = []

    def f(x):
        calls.append(1)  # a side effect: runs at capture only
        return x * 2

    compiled = aotgrad.aot_function(f)
    compiled(torch.ones(2))
    compiled(torch.ones(2))
    compiled(torch.ones(2))
    assert aotgrad.cache_info(compiled).misses == 1


def test_the_cache_limit_warning_fires_once():
    compiled = aotgrad.aot_function(lambda x, n: x * n, cache_limit=1)
    compiled(torch.ones(1), 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(2, 6):
            torch.testing.assert_close(compiled(torch.ones(1), n), torch.full((1,), float(n)))
    assert len([w for w in caught if "cache_limit" in str(w.message)]) == 1
    assert aotgrad.cache_info(compiled).fallbacks == 4


# --- ambient state (Note [Ambient state]) ------------------------------------------------------


def test_a_call_outside_autocast_after_one_inside_is_not_lower_precision():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    compiled = aotgrad.aot_function(lambda x: lin(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = compiled(x)
        assert inside.dtype == lin(x).dtype == torch.bfloat16
    outside = compiled(x)  # the fast path of the last entry must not serve it
    assert outside.dtype == torch.float32
    torch.testing.assert_close(outside, lin(x))
    assert aotgrad.cache_info(compiled).reasons[-1] == "autocast cpu/bfloat16 != off"


def test_a_call_inside_autocast_after_one_outside_traces_again():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    compiled = aotgrad.aot_function(lambda x: lin(x))
    compiled(x)
    compiled(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x), lin(x))
    with torch.autocast("cpu", dtype=torch.float16):
        assert compiled(x).dtype == torch.float16
    assert aotgrad.cache_info(compiled).misses == 3


def test_the_default_dtype_is_guarded():
    compiled = aotgrad.aot_function(lambda x: torch.ones(2) + x.sum())
    x = torch.randn(2)
    compiled(x)
    compiled(x)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert compiled(x).dtype == (torch.ones(2) + x.sum()).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert (
        aotgrad.cache_info(compiled).reasons[-1] == "default dtype torch.float32 != torch.float64"
    )


# --- module hooks (Note [Module hooks]) ---------------------------------------------------------


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_a_forward_hook_registered_after_the_first_call_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    compiled = aotgrad.aot_module(model)
    x = torch.randn(2, 4)
    compiled(x)
    handle = model[0].register_forward_hook(lambda module, args, out: out * 2)
    torch.testing.assert_close(compiled(x), model(x))
    assert aotgrad.cache_info(compiled).reasons[-1] == (
        "the values the function reads changed: added ['closure self.0._forward_hooks'], removed none"
    )
    handle.remove()
    torch.testing.assert_close(compiled(x), model(x))  # the hookless entry again
    assert aotgrad.cache_info(compiled).misses == 2


def test_a_backward_hook_registered_after_the_first_call_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    compiled = aotgrad.aot_module(model)
    x = torch.randn(2, 4)
    compiled(x).sum().backward()
    model.zero_grad()
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 3,))
    model(x).sum().backward()
    expected = _grads(model)
    model.zero_grad()
    compiled(x).sum().backward()
    for got, want in zip(_grads(model), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("frontend", ["closure", "aot_module", "argument"])
def test_a_hook_registered_after_a_call_retraces(frontend):
    # Note [Module hooks]: the trace bakes in the hooks present at capture
    lin, x = nn.Linear(2, 2), torch.ones(1, 2)
    compiled, args = {
        "closure": (aotgrad.aot_function(lambda x: lin(x)), (x,)),
        "aot_module": (aotgrad.aot_module(lin), (x,)),
        "argument": (aotgrad.aot_function(lambda m, x: m(x)), (lin, x)),
    }[frontend]
    compiled(*args)
    handle = lin.register_forward_hook(lambda m, i, o: o * 100)
    torch.testing.assert_close(compiled(*args), lin(x))
    pre = lin.register_forward_pre_hook(lambda m, i: (i[0] + 1,))
    torch.testing.assert_close(compiled(*args), lin(x))
    handle.remove()
    pre.remove()
    torch.testing.assert_close(compiled(*args), lin(x))
    info = aotgrad.cache_info(compiled)
    assert info.misses == 3 and info.hits == 1  # the last call is the first one again
    assert "_forward_hooks" in info.reasons[1]


def test_a_global_module_hook_registered_after_a_call_retraces():
    lin, x = nn.Linear(2, 2), torch.ones(1, 2)
    compiled = aotgrad.aot_function(lambda x: lin(x))  # (an AOTModule is a module: hooked too)
    compiled(x)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o * 100)
    try:
        torch.testing.assert_close(compiled(x), lin(x))
    finally:
        handle.remove()
    assert aotgrad.cache_info(compiled).misses == 2


def test_a_global_module_hook_runs_once_through_aot_module():
    """Note [The wrapper runs no global hooks]."""
    model = nn.Sequential(nn.Linear(3, 3))
    compiled = aotgrad.aot_module(model)
    x = torch.randn(2, 3)
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: out + 1)
    try:
        torch.testing.assert_close(compiled(x), model(x))
        compiled.register_forward_hook(lambda module, args, out: out * 2)
        with pytest.raises(aotgrad.errors.CallError, match="run twice"):
            compiled(x)
    finally:
        handle.remove()
    torch.testing.assert_close(compiled(x), model(x) * 2)  # the wrapper's own hook runs
