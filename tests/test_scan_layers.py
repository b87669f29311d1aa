"""``aotgrad.scan_layers`` against the unrolled loop of layers: values and every ``.grad``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from models import GPT, Block


def _unrolled(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _check(layers, x, **options):
    twin = copy.deepcopy(layers)
    x_twin = x.detach().clone().requires_grad_(x.requires_grad)
    want = _unrolled(twin, x_twin)
    got = aotgrad.scan_layers(layers, x, **options)
    torch.testing.assert_close(got, want)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for (name, p), q in zip(layers.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    if x.requires_grad:
        torch.testing.assert_close(x.grad, x_twin.grad)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("partition", ["save_all", "mincut"])
def test_gpt_blocks(checkpoint, partition):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(16, 2) for _ in range(3))
    _check(
        blocks,
        torch.randn(2, 5, 16, requires_grad=True),
        checkpoint=checkpoint,
        partition=partition,
    )


def test_one_capture_for_any_depth():
    blocks = nn.ModuleList(Block(16, 2) for _ in range(4))
    x = torch.randn(2, 5, 16)
    aotgrad.scan_layers(blocks, x)
    aotgrad.scan_layers(blocks[:2], x)  # same layer 0, two layers
    run = aotgrad.scan_layers_function(blocks)
    assert run is aotgrad.scan_layers_function(blocks[:2])  # keyed by layer 0 and options
    assert run.captures == 1
    names = [str(d) for d in run.traced.signature.forward_inputs]
    assert names[:2] == ["carry", "x['ln1.weight']"]


class ScannedGPT(GPT):
    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = aotgrad.scan_layers(self.blocks, x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def test_a_training_step_of_a_gpt():
    torch.manual_seed(0)
    scanned = ScannedGPT(blocks=3)
    plain = GPT(blocks=3)
    plain.load_state_dict(scanned.state_dict())
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    for model in (scanned, plain):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(idx, targets).backward()
        opt.step()
    for (name, a), b in zip(scanned.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    torch.testing.assert_close(scanned(idx, targets), plain(idx, targets))


def test_buffers_are_rows_too():
    class Scaled(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("scale", torch.tensor(scale))

        def forward(self, x):
            return self.lin(x) * self.scale

    _check(nn.ModuleList(Scaled(s) for s in (1.0, 2.0, 3.0)), torch.randn(2, 3))


def test_dropout_in_layers_draws_as_the_unrolled_loop():
    layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(3))
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    want = _unrolled(layers, x)
    torch.manual_seed(1)
    got = aotgrad.scan_layers(layers, x)
    torch.testing.assert_close(got, want)
    layers.eval()  # another mode: another capture, no dropout
    torch.testing.assert_close(aotgrad.scan_layers(layers, x), _unrolled(layers, x))


def test_different_shapes_are_named():
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])
    with pytest.raises(aotgrad.ScanError, match=r"layer 2 \(Linear\) differs from layer 0"):
        aotgrad.scan_layers(layers, torch.randn(2, 4))


def test_different_module_types_are_named():
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(aotgrad.ScanError, match="module 1: layer 0 has ReLU, layer 1 has Tanh"):
        aotgrad.scan_layers(nn.ModuleList([a, b]), torch.randn(2, 4))


def test_different_dtypes_are_named():
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4).double()])
    with pytest.raises(aotgrad.ScanError, match=r"parameter weight.*float64"):
        aotgrad.scan_layers(layers, torch.randn(2, 4))


def test_buffer_updates_are_refused():
    layers = nn.ModuleList(nn.BatchNorm1d(4) for _ in range(2))
    with pytest.raises(aotgrad.ScanError, match="mutates"):
        aotgrad.scan_layers(layers, torch.randn(3, 4))
