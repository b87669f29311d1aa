"""The named cache key: every field's miss reason, the one specialization cache, explicit dims."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.api import AOTFunction, Options
from aotgrad.cache import CacheKey
from aotgrad.capture.analyses.dynamic import requested_dims
from aotgrad.signature.lifting import NOTHING, State

SCALE = 2


def key(*leaves, dims=None, structure=None, lifted=NOTHING):
    structure = len(leaves) if structure is None else structure
    return CacheKey.of_call(structure=structure, leaves=list(leaves), dims=dims, lifted=lifted)


def reasons(fn, *calls, **options):
    """The miss reasons of ``aot_function(fn)`` called with each of ``calls`` (argument tuples)."""
    compiled = aotgrad.aot_function(fn, **options)
    for args in calls:
        compiled(*args)
    return aotgrad.cache_info(compiled).reasons


X = torch.ones(3, 4)


# --- each field of the key, as CacheKey.explain tells it: "what: cached != this call" ------------


@pytest.mark.parametrize(
    ("new", "reason"),
    [
        (torch.ones(4, 3), "input x: shape (3, 4) != (4, 3)"),
        (torch.ones(4, 8)[:, :4][:3], "input x: stride (4, 1) != (8, 1)"),
        (torch.ones(13)[1:].view(3, 4), "input x: storage offset 0 != 1"),
        (X.double(), "input x: dtype torch.float32 != torch.float64"),
        (torch.ones(3, 4, device="meta"), "input x: device cpu != meta"),
        (torch.ones(3, 4, requires_grad=True), "input x: requires_grad False != True"),
        (X.to_sparse(), "input x: layout torch.strided != torch.sparse_coo"),
        (nn.Parameter(torch.ones(3, 4)), "input x: type Tensor != Parameter"),
        (2.0, "input x: a tensor of shape (3, 4) != value 2.0"),
    ],
    ids=["shape", "stride", "offset", "dtype", "device", "grad", "layout", "type", "value"],
)
def test_each_tensor_field_is_named(new, reason):
    assert key(new).explain(key(torch.ones(3, 4)), names=["x"]) == reason


def test_values_are_shown_as_the_values():
    assert key(X, -0.0).explain(key(X, 0.0), names=["x", "n"]) == "input n: value 0.0 != -0.0"
    assert key(X, True).explain(key(X, 1), names=["x", "n"]) == "input n: value 1 != True"


def test_leaves_without_names_are_numbered():
    assert key(torch.ones(2)).explain(key(torch.ones(3))) == "leaf 0: shape (3,) != (2,)"


def test_the_structure():
    reason = key(X, X).explain(key(X))
    assert reason == "argument structure changed: 1 positional argument != 2 positional arguments"
    assert reasons(lambda x: x["a"] * 2 if isinstance(x, dict) else x, (X,), ({"a": X},))[
        1
    ].startswith("argument structure changed: 1 positional argument != TreeSpec")


def test_dynamic_dimensions_are_named_not_read_as_strides():
    # Was "input x: stride True != False": the dynamic key's contiguity read as a stride.
    static, dynamic = key(X), key(X, dims=((0,),))
    assert dynamic.explain(static, names=["x"]) == "input x: dynamic dimensions none != (0,)"
    assert static.explain(dynamic, names=["x"]) == "input x: dynamic dimensions (0,) != none"
    other = key(X, dims=((1,),))
    assert other.explain(dynamic, names=["x"]) == "input x: dynamic dimensions (0,) != (1,)"


def test_a_dynamic_tensors_fields_are_its_own():
    dynamic = key(X, dims=((0,),))
    wider = key(torch.ones(3, 5), dims=((0,),))
    strided = key(torch.ones(3, 8)[:, :4], dims=((0,),))
    assert wider.explain(dynamic, names=["x"]) == "input x: shape (*, 4) != (*, 5)"
    assert strided.explain(dynamic, names=["x"]) == "input x: contiguous True != False"


def test_aliasing_names_the_inputs_that_share_memory():
    y = torch.ones(3, 4)
    shared = key(X, X)
    assert shared.explain(key(X, y), names=["x", "y"]) == (
        "inputs sharing memory: none (no views) != x and y"
    )
    base = torch.ones(6, 4)
    views = key(base[:3], base[:3].view(3, 4))
    assert views.explain(key(X, y), names=["x", "y"]).endswith("!= x and y")


def test_the_ambient_state():
    plain = key(X)
    with torch.no_grad():
        no_grad = key(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = key(X)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        double = key(X)
    finally:
        torch.set_default_dtype(old)
    assert no_grad.explain(plain) == "grad mode True != False"
    assert autocast.explain(plain) == "autocast off != cpu/bfloat16"
    assert plain.explain(autocast) == "autocast cpu/bfloat16 != off"
    assert double.explain(plain) == "default dtype torch.float32 != torch.float64"


def test_the_lifted_state():
    lin = nn.Linear(2, 2)
    state = State(lin)
    before = key(X, lifted=state.read())
    lin.weight.requires_grad_(False)
    assert key(X, lifted=state.read()).explain(before) == (
        "param weight: requires_grad True != False"
    )
    lin.register_buffer("extra", torch.ones(2))
    assert key(X, lifted=state.read()).explain(before) == (
        "lifted tensors changed: added ['buffer extra'], removed none"
    )


def test_values_the_function_reads():
    global SCALE
    try:
        compiled = aotgrad.aot_function(lambda x: x * SCALE)
        compiled(X)
        SCALE = 3
        compiled(X)
        assert aotgrad.cache_info(compiled).reasons[-1] == "global SCALE: value 2 != 3"
    finally:
        SCALE = 2


def test_the_first_call_and_equal_keys():
    assert key(X).explain(None) == "first call"
    assert key(X).explain(key(torch.zeros(3, 4))) == "no field of the key differs"


def test_equal_calls_have_equal_keys():
    assert key(X) == key(torch.zeros(3, 4)) and hash(key(X)) == hash(key(torch.zeros(3, 4)))
    assert key(X) != key(X)._replace(retrace=1)


# --- one specialization cache ---------------------------------------------------------------------


def test_calls_with_an_equal_key_and_other_sizes_are_retraces_of_that_key():
    # Note [Entries with shape guards]: the second trace sits under the key, retrace=1.
    f = aotgrad.aot_function(lambda y: y * int(y.shape[1]), dynamic=True)
    for width in (4, 6, 4, 6):
        torch.testing.assert_close(f(torch.ones(2, width)), torch.full((2, width), float(width)))
    assert sorted(k.retrace for k in f.cache.entries) == [0, 1]
    first, second = sorted(f.cache.entries, key=lambda k: k.retrace)
    assert second.explain(first) == "no field of the key differs"
    assert aotgrad.cache_info(f).reasons == ["first call", "shape guard y.size()[1] == 4 failed"]


def test_a_full_cache_says_why_a_repeated_call_missed():
    f = aotgrad.aot_function(lambda x, n: x * n, cache_limit=1)
    f(X, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(X, 2)
        f(X, 2)
    assert aotgrad.cache_info(f).reasons == [
        "first call",
        "input n: value 1 != 2",
        "the same key as the previous miss, which ran eagerly (cache_limit)",
    ]


def test_a_call_after_a_failed_trace_says_so():
    def f(x):
        if x.sum() > 0:  # data-dependent: the trace raises
            return x
        return -x

    compiled = aotgrad.aot_function(f)
    for _ in range(2):
        with pytest.raises(aotgrad.DataDependentError):
            compiled(X)
    assert aotgrad.cache_info(compiled).reasons == [
        "first call",
        "the same key as the previous miss, which raised before its entry was stored",
    ]


def test_the_full_cache_warning_points_at_the_callers_line():
    f = aotgrad.aot_function(lambda x, n: x * n, cache_limit=1)
    f(X, 1)
    with pytest.warns(UserWarning, match="cache_limit") as caught:
        f(X, 2)
    assert caught[0].filename == __file__


# --- dynamic dimensions, passed explicitly (Note [Marking dimensions dynamic]) ------------------


def test_marks_are_read_per_call_into_the_key():
    f = aotgrad.aot_function(lambda x: x * 2)
    f(aotgrad.dynamic(torch.ones(4, 3), dim=0))
    f(torch.ones(4, 3))  # the same tensor metadata, unmarked: a static entry
    f(aotgrad.dynamic(torch.ones(9, 3), dim=0))  # the dynamic entry serves it
    info = aotgrad.cache_info(f)
    assert info.reasons == ["first call", "input x: dynamic dimensions (0,) != none"]
    assert (info.hits, info.entries) == (1, 2)


def test_requested_dims_reads_marks_and_dynamic_true():
    marked = aotgrad.dynamic(torch.ones(8, 4), dim=(0, -1))
    assert requested_dims([marked, torch.ones(8, 4), 1], everything=False) == ((0, 1), (), ())
    assert requested_dims([torch.ones(8, 1), "a"], everything=True) == ((0,), ())
    assert requested_dims([torch.ones(8, 4)], everything=False) is None
    assert requested_dims([torch.ones(1, 1)], everything=True) is None


def test_dims_given_to_the_function_serve_every_call_without_marks():
    compiled = AOTFunction(lambda x, w: (x @ w).relu(), Options(), dynamic_dims=((0,), ()))
    w = torch.randn(4, 2)
    for batch in (3, 5, 11):
        x = torch.randn(batch, 4)
        torch.testing.assert_close(compiled(x, w), (x @ w).relu())
        assert not hasattr(x, "_aotgrad_dynamic_dims")
    assert (compiled.info.misses, compiled.info.entries) == (1, 1)
    assert compiled.partitioned.joint.guards is not None  # a dynamic trace


def _double(x):
    return x * 2


def test_a_pickled_function_keeps_its_dims_and_options():
    compiled = AOTFunction(_double, Options(cache_limit=3), dynamic_dims=((0,),))
    copied = pickle.loads(pickle.dumps(compiled))
    for batch in (3, 5):
        torch.testing.assert_close(copied(torch.ones(batch, 2)), torch.full((batch, 2), 2.0))
    assert copied.info.entries == 1 and copied.cache.limit == 3


def test_trace_reads_marks():
    traced = aotgrad.trace(lambda x: x.sin() * x.shape[0], aotgrad.dynamic(torch.ones(5, 3), 0))
    assert "sym_size" in traced.forward.code


# --- contracts by keyword -------------------------------------------------------------------------


def test_options_are_built_by_keyword():
    with pytest.raises(TypeError):
        Options(None, None)  # type: ignore[misc]
    assert Options(partition="mincut").partition == "mincut"


def test_a_compiled_traced_keeps_the_autocast_it_was_captured_under():
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        traced = aotgrad.trace(lambda x, w: x @ w, x, w)
        assert traced.compile(aotgrad.nop)(x, w).dtype == torch.bfloat16
