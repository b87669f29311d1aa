"""Random ops draw exactly what eager draws at the same seed, whatever the layout they fill."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.utils.checkpoint import checkpoint

import aotgrad
from aotgrad.testing import verify

# Layouts of the tensor a random op fills: eager's kernels draw in memory order.
LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x.t(),
    "expanded": lambda x: x[:1].expand(x.shape[0], x.shape[1]),
    "strided gaps": lambda x: x[:, ::2],
    "transposed gaps": lambda x: x.t()[::2],
}

OPS = {
    "dropout": lambda y: F.dropout(y, 0.5),
    "alpha_dropout": lambda y: F.alpha_dropout(y, 0.3, True),
    "rand_like": lambda y: torch.rand_like(y) * y,
    "randn_like": lambda y: torch.randn_like(y) + y,
    "bernoulli_ float": lambda y: y.clone().bernoulli_(0.3) * y,
    "normal_": lambda y: y * 1 + torch.empty_like(y).normal_(),
    "uniform_ of a view": lambda y: (y * 1).t().uniform_(-1, 1),
    "exponential_": lambda y: y * torch.empty_like(y).exponential_(),
    "two draws in order": lambda y: F.dropout(y, 0.5) + torch.rand_like(y),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(OPS))
def test_random_op_draws_as_eager_on_layout(op, layout):
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    verify(lambda x: OPS[op](LAYOUTS[layout](x)), x)


def test_dropout_on_channels_last_draws_as_eager():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    verify(lambda x: F.dropout(x, 0.5), x)


def test_in_place_fill_of_a_transposed_input_view():
    verify(lambda x: x.t().bernoulli_(0.4) * 1, torch.zeros(5, 6))


def test_dropout_of_transposed_under_checkpoint_draws_once():
    def f(x):
        return checkpoint(lambda y: F.dropout(y.t(), 0.5).sin(), x, use_reentrant=False)

    verify(f, torch.randn(4, 6, requires_grad=True))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.native_dropout(x, 0.5, True)[0],
        lambda x: F.dropout(x.t(), 0.5),
        lambda x: torch.native_dropout(x, 0.5, False)[0] * 2,
    ],
    ids=["native_dropout", "dropout of transposed", "native_dropout in eval"],
)
def test_decompositions_keep_eager_draws(fn):
    # torch's native_dropout decomposition draws uniforms where eager draws Bernoullis.
    aten = torch.ops.aten
    table = {**core_aten_decompositions(), **get_decompositions([aten.native_dropout])}
    compile_fn = functools.partial(aotgrad.aot_function, decompositions=table)
    verify(fn, torch.randn(4, 6, requires_grad=True), compile_fn=compile_fn)


def test_multihead_attention_batch_first_with_dropout():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 5, 8, requires_grad=True)
    verify(lambda x: mha(x, x, x)[0], x)


def test_transformer_encoder_layer_with_dropout():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True).train()
    verify(layer, torch.randn(2, 5, 8, requires_grad=True))


def test_torchvision_vit_with_dropout():
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(
        image_size=8,
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
        dropout=0.2,
        attention_dropout=0.3,
        num_classes=3,
    ).train()
    verify(model, torch.randn(2, 3, 8, 8), rtol=1e-4, atol=1e-5)


def test_seeding_inside_the_function_is_refused_before_the_generator_changes():
    def f(x):
        torch.manual_seed(0)  # the line the error names
        return F.dropout(x, 0.5)

    state = torch.get_rng_state()
    with pytest.raises(aotgrad.errors.UnsupportedOpError, match="reseeds") as caught:
        aotgrad.aot_function(f)(torch.ones(8))
    assert "torch.manual_seed(0)  # the line the error names" in str(caught.value)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.manual_seed is torch.random.manual_seed  # restored after the capture
    torch.manual_seed(0)  # and works again
