"""Pointwise outputs with eager's strides (Note [Eager strides of pointwise ops]): a VAE-like
stack with GroupNorm at batch 1 runs as eager, where the kernel refused a layout capture
had mispredicted ("Expected X.is_contiguous(memory_format)")."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad


class _Attention(nn.Module):
    """diffusers' VAE mid-block attention: tokens by transpose, back by reshape, residual."""

    def __init__(self, c):
        super().__init__()
        self.group_norm = nn.GroupNorm(32, c)
        self.to_q, self.to_k, self.to_v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.to_out = nn.Linear(c, c)

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        q, k, v = self.to_q(t)[:, None], self.to_k(t)[:, None], self.to_v(t)[:, None]
        out = self.to_out(F.scaled_dot_product_attention(q, k, v)[:, 0])
        out = out.transpose(-1, -2).reshape(b, c, h, w)
        return (out + x) / 1.0


class _Resnet(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(32, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(32, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class _Decoder(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.conv_in = nn.Conv2d(4, c, 3, padding=1)
        self.mid = nn.Sequential(_Resnet(c), _Attention(c), _Resnet(c))
        self.norm_out = nn.GroupNorm(32, c)
        self.conv_out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, z):
        return self.conv_out(F.silu(self.norm_out(self.mid(self.conv_in(z)))))


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "full"])
@pytest.mark.parametrize("batch", [1, 2])
def test_vae_like_groupnorm_stack_matches_eager(batch, fast):
    torch.manual_seed(0)
    model = _Decoder()
    ref = copy.deepcopy(model)
    z = torch.randn(batch, 4, 4, 4)
    out = aotgrad.aot_module(model, fast=fast)(z)
    want = ref(z)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    want.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


def test_a_pointwise_op_keeps_its_operands_strides_as_eager():
    def f(x, p):
        b, c, h, w = x.shape
        y = (x.view(b, c, h * w).transpose(1, 2) @ p).transpose(-1, -2).reshape(b, c, h, w)
        y = (y + x) / 1.0
        return y, F.group_norm(y, 32)

    x = torch.randn(1, 64, 4, 4, requires_grad=True)
    p = torch.randn(64, 64, requires_grad=True)
    got, got_norm = aotgrad.aot_function(f)(x, p)
    want, want_norm = f(x, p)
    assert got.stride() == want.stride() == (64, 1, 256, 64)
    torch.testing.assert_close(got_norm, want_norm)
