"""Note [The caller's saved-tensor hooks]: the caller's hooks are never traced into the graphs."""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

import aotgrad
from aotgrad._torch_compat import FakeTensor


def f(x, w):
    return (x @ w).sin().sum()


def _to_bf16(t):
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _to_f32(t):
    return t.to(torch.float32) if t.is_floating_point() else t


def _grads(fn, x, w):
    x.grad = w.grad = None
    fn(x, w).backward()
    return x.grad.clone(), w.grad.clone()


def test_a_capture_under_the_callers_hooks_leaves_them_out_of_the_graphs():
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    compiled = aotgrad.aot_function(f)
    with saved_tensors_hooks(_to_bf16, _to_f32):
        _grads(compiled, x, w)  # the capture happens here
    for got, want in zip(_grads(compiled, x, w), _grads(f, x, w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    code = compiled.partitioned.backward.code + compiled.partitioned.forward.code
    assert "bfloat16" not in code


def test_the_callers_hooks_see_the_saved_values_of_every_call_and_stay_active():
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    compiled = aotgrad.aot_function(f)
    with saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x, w)  # first call: capture, then the compiled Function saves
        assert packed and not any(isinstance(t, FakeTensor) for t in packed)
        count = len(packed)
        x.sin()  # the caller's hook is still on the stack after the capture
        assert len(packed) == count + 1
    out.backward()
    torch.testing.assert_close(x.grad, _grads(f, x.detach().requires_grad_(), w)[0])
