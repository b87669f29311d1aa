"""The per-call fast path (Note [Where a call's microseconds go]): it serves exactly the calls
the full key would give the same entry, and every other call takes the full path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotgrad
from aotgrad.cache.specializations import ambient_key, common_state
from aotgrad.runtime import CompiledGraphs


def f(x, w):
    return (x @ w).relu().sum()


def _warm(fn=f):
    """A compiled ``fn`` whose last entry (Note [The last entry]) serves ``(x, w)``."""
    compiled = aotgrad.aot_function(fn, disk_cache=False)
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    compiled(x, w)
    compiled(x, w)  # a hit through the dict: now the last entry
    assert compiled.cache._last is not None
    return compiled, x, w


def _flipped_settings():
    """Each torch setting of ``cache.SETTINGS`` (and the rest of the ambient state) away from
    its default, one at a time."""

    @contextlib.contextmanager
    def flag(setter, getter):
        old = getter()
        setter(not old)
        try:
            yield
        finally:
            setter(old)

    backends = torch.backends
    return {
        "flash_sdp": lambda: flag(backends.cuda.enable_flash_sdp, backends.cuda.flash_sdp_enabled),
        "mem_efficient_sdp": lambda: flag(
            backends.cuda.enable_mem_efficient_sdp, backends.cuda.mem_efficient_sdp_enabled
        ),
        "math_sdp": lambda: flag(backends.cuda.enable_math_sdp, backends.cuda.math_sdp_enabled),
        "cudnn_sdp": lambda: flag(backends.cuda.enable_cudnn_sdp, backends.cuda.cudnn_sdp_enabled),
        "sdp_priority": lambda: sdpa_kernel(
            [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True
        ),
        "math_sdp_reduction": lambda: flag(
            backends.cuda.allow_fp16_bf16_reduction_math_sdp,
            backends.cuda.fp16_bf16_reduction_math_sdp_allowed,
        ),
        "deterministic": lambda: flag(
            torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled
        ),
        "cudnn": lambda: backends.cudnn.flags(enabled=False),
        "mkldnn": lambda: backends.mkldnn.flags(enabled=False),
        "mha_fastpath": lambda: flag(
            backends.mha.set_fastpath_enabled, backends.mha.get_fastpath_enabled
        ),
        "default_device": lambda: torch.device("cpu"),
        "default_dtype": lambda: _default_dtype(torch.float64),
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "forward-AD level": torch.autograd.forward_ad.dual_level,
    }


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("name", list(_flipped_settings()))
def test_the_common_state_check_fails_when_the_key_would_differ(name):
    # Note [The common state, checked fast]: True only where the ambient key is the grad mode.
    assert common_state() and ambient_key() is True
    with _flipped_settings()[name]():
        assert not common_state()
        if name != "forward-AD level":  # not part of the key: a transform runs the function
            assert ambient_key() is not True
    assert common_state()


@pytest.mark.parametrize(
    "name", ["sdp_priority", "deterministic", "mkldnn", "default_device", "autocast"]
)
def test_a_warm_function_misses_under_another_ambient_state(name):
    compiled, x, w = _warm()
    with _flipped_settings()[name]():
        out = compiled(x, w)
        expected = f(x, w)
    torch.testing.assert_close(out, expected)
    assert out.dtype == expected.dtype
    info = aotgrad.cache_info(compiled)
    assert info.misses == 2, info.reasons


def test_a_warm_function_under_no_grad_returns_no_graph():
    compiled, x, w = _warm()
    with torch.no_grad():
        out = compiled(x, w)
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize(
    "make",
    [
        lambda x, w: (x, w.detach()),  # requires_grad off
        lambda x, w: (x, x.detach().requires_grad_()),  # x's storage twice, neither a view
        lambda x, w: (w.detach(), w),  # the same memory as two inputs, neither a view
        lambda x, w: (torch.randn(5, 4)[1:], w),  # a view with an offset
        lambda x, w: (torch.randn(4, 4).t(), w),  # a view: other strides
        lambda x, w: (x, _set_onto(x).requires_grad_()),  # x's storage through set_, offset 0
        lambda x, w: (w, w),  # the same tensor twice
    ],
)
def test_the_last_entry_serves_no_other_tensors(make):
    compiled, x, w = _warm()
    args = make(x, w)
    out = compiled(*args)
    expected = f(*args)
    torch.testing.assert_close(out, expected)
    assert out.requires_grad == expected.requires_grad
    assert aotgrad.cache_info(compiled).hits == 1  # the warm-up's, only


def _set_onto(x):
    other = torch.empty(0)
    return other.set_(x.untyped_storage(), 0, (4, 4), (4, 1))


def test_requires_grad_flipped_in_place_is_seen():
    compiled, x, w = _warm()
    w.requires_grad_(False)
    assert not compiled(x, w).requires_grad
    w.requires_grad_(True)
    out = compiled(x, w)
    out.backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(f(x, w), w)[0])


def test_inputs_without_memory_fall_back_to_the_full_check():
    # Both empty: no address tells their storages apart (``data_ptr`` 0).
    compiled = aotgrad.aot_function(lambda a, b: a + b, disk_cache=False)
    a, b = torch.empty(0, 3), torch.empty(0, 3, requires_grad=True)
    for _ in range(3):
        out = compiled(a, b)
    assert out.shape == (0, 3) and out.requires_grad
    assert aotgrad.cache_info(compiled).hits == 2


def test_a_dead_functorch_wrapper_fails_the_guard():
    # The direct call skips ``unwrap_if_dead`` (Note [Calling the Function directly]): the
    # C++ check must refuse a tensor that escaped a transform (its dispatch keys differ).
    compiled, x, w = _warm()
    escaped = []
    torch.func.grad(lambda t: escaped.append(t) or t.sum())(torch.randn(4, 4))
    (dead,) = escaped
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    guard = compiled.cache._last.guard
    assert guard((x, w)) and not guard((dead, w)) and not guard((x, dead))


def test_under_a_transform_the_function_runs():
    compiled, x, w = _warm()
    grad = torch.func.grad(lambda w: compiled(x, w))(w.detach())
    torch.testing.assert_close(grad, torch.func.grad(lambda w: f(x, w))(w.detach()))
    assert aotgrad.cache_info(compiled).transform_runs == 1


def test_a_capture_traces_through_a_warm_function():
    inner, x, w = _warm()
    outer = aotgrad.aot_function(lambda x, w: inner(x, w) * 2, disk_cache=False)
    out = outer(x, w)
    torch.testing.assert_close(out, f(x, w) * 2)
    assert aotgrad.cache_info(inner).hits == 1  # the capture ran the function itself


def test_anomaly_mode_sees_the_compiled_backward():
    compiled, x, w = _warm(lambda x, w: (x @ w).sqrt().sum())
    x, w = -torch.ones(4, 4), torch.ones(4, 4, requires_grad=True)
    compiled(x, w)
    compiled(x, w)  # the last entry again, for these inputs
    with torch.autograd.detect_anomaly(), pytest.warns(UserWarning, match="Traceback"):
        out = compiled(x, w)
        with pytest.raises(RuntimeError, match="returned nan"):
            out.backward()


def test_a_second_derivative_after_fast_calls_reads_the_kept_input():
    # Note [Primals in the backward]: the fast forward keeps ``w`` with its version.
    compiled, x, w = _warm(lambda x, w: (x @ w).sin().sum())
    (g,) = torch.autograd.grad(compiled(x, w), w, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), w)
    (eg,) = torch.autograd.grad((x @ w).sin().sum(), w, create_graph=True)
    torch.testing.assert_close(gg, torch.autograd.grad(eg.sum(), w)[0])
    out = compiled(x, w)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(aotgrad.errors.DoubleBackwardError, match="changed in place"):
        torch.autograd.grad(out, w, create_graph=True)


def test_graphs_read_from_disk_take_the_direct_call(cache_dir, monkeypatch):
    """Graphs read from a file do not know which inputs required grad at the trace; the last
    entry's guard does, so ``x`` (no gradient reaches it, it does not require grad) needs no
    cut and the call needs no epilogue."""
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    aotgrad.aot_function(f)(x, w)  # traced, written to disk
    compiled = aotgrad.aot_function(f)
    compiled(x, w)  # read from disk
    compiled(x, w)  # a hit through the dict: now the last entry
    assert aotgrad.cache_info(compiled).disk_hits == 1

    def refuse(self, primals):
        raise AssertionError("the last entry went through CompiledGraphs.__call__")

    monkeypatch.setattr(CompiledGraphs, "__call__", refuse)
    out = compiled(x, w)
    out.backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(f(x, w), w)[0])
