"""Checkpoints on real models: reentrant grads, state updated in a recompute, random ops, masks."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import aotgrad


def _compare_module(make, *args, **kwargs):
    """Run a fresh module eagerly and through aot_module at one seed; compare every value."""
    eager, compiled = make(), None
    compiled = copy.deepcopy(eager)
    torch.manual_seed(1)
    expected = eager(*args, **kwargs)
    torch.manual_seed(1)
    got = aotgrad.aot_module(compiled)(*args, **kwargs)
    loss_e = expected if isinstance(expected, torch.Tensor) else expected.loss
    loss_c = got if isinstance(got, torch.Tensor) else got.loss
    torch.testing.assert_close(loss_c, loss_e)
    loss_e.backward()
    loss_c.backward()
    for (name, p), (_, q) in zip(
        eager.named_parameters(), compiled.named_parameters(), strict=True
    ):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert type(q.grad) is torch.Tensor, name
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    for (name, b), (_, c) in zip(eager.named_buffers(), compiled.named_buffers(), strict=True):
        assert torch.equal(b, c), name


class _Reentrant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(cp.checkpoint(self.fc, x, use_reentrant=True).relu()).sum()


def test_reentrant_checkpoint_gives_module_parameters_real_grads():
    x = torch.randn(3, 4, requires_grad=True)
    _compare_module(_Reentrant, x)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_closed_over_module_under_a_checkpoint_gets_real_grads_like_eager(use_reentrant):
    torch.manual_seed(0)
    lin, out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    twin_lin, twin_out = copy.deepcopy(lin), copy.deepcopy(out)

    def step(x, lin=lin, out=out):
        return out(cp.checkpoint(lambda y: lin(y).tanh(), x, use_reentrant=use_reentrant)).sum()

    x = torch.randn(3, 4, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    compiled = aotgrad.aot_function(step)
    for _ in range(2):  # the second call reuses the entry and accumulates like eager
        compiled(x).backward()
        step(x_twin, twin_lin, twin_out).backward()
    for name in ("weight", "bias"):
        for ours, theirs in ((lin, twin_lin), (out, twin_out)):
            got = getattr(ours, name).grad
            assert type(got) is torch.Tensor, name
            torch.testing.assert_close(got, getattr(theirs, name).grad, msg=name)
    torch.testing.assert_close(x.grad, x_twin.grad)
    assert aotgrad.cache_info(compiled).misses == 1


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoint_recompute_reads_closed_over_tensors_as_inputs(use_reentrant):
    # Note [The swap spans the backward]: the recompute once read the real weight,
    # baked into the backward graph as a constant.
    lin = torch.nn.Linear(4, 4)
    traced = aotgrad.trace(
        lambda x: cp.checkpoint(lambda y: lin(y).sin(), x, use_reentrant=use_reentrant).sum(),
        torch.randn(3, 4, requires_grad=True),
    )
    assert traced.backward is not None
    assert not [n for n in traced.backward.graph.nodes if n.op == "get_attr"]
    assert lin.weight.grad is None and lin.bias.grad is None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_batchnorm_updated_again_by_a_recompute_updates_as_eager(use_reentrant):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return cp.checkpoint(
                lambda y: self.bn(self.fc(y)), x, use_reentrant=use_reentrant
            ).sum()

    net = Net().double()  # float64: the buffers compare exactly
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    _compare_module(lambda: copy.deepcopy(net), x)  # Note [State updated by the backward]
    net.bn.eval()  # no state update
    _compare_module(lambda: copy.deepcopy(net), x)


class _Layers(torch.nn.Module):
    """Identical checkpointed layers with dropout: every layer's mask reads the same."""

    def __init__(self, use_reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(
                lambda y, layer=layer: F.dropout(layer(y).tanh(), 0.5),
                x,
                use_reentrant=self.use_reentrant,
            )
        return x.sum()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_dropout_in_identical_checkpointed_layers_reuses_each_layers_mask(use_reentrant):
    x = torch.randn(4, 8, requires_grad=True)
    _compare_module(lambda: _Layers(use_reentrant), x)


def test_capture_leaves_the_generator_as_it_was():
    x, model = torch.randn(4, 8, requires_grad=True), _Layers(False)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    aotgrad.trace(model, x)
    assert torch.equal(torch.get_rng_state(), state)


def _transformers():
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    return pytest.importorskip("transformers")


def _bert(checkpointing):
    transformers = _transformers()
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    return model


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_bert_with_attention_mask_dropout_and_checkpointing_matches_eager(checkpointing):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    _compare_module(lambda: _bert(checkpointing), input_ids=ids, attention_mask=mask, labels=ids)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gpt2_with_dropout_and_checkpointing_matches_eager(use_reentrant):
    transformers = _transformers()

    def make():
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, use_cache=False
        )
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
        )
        return model

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    _compare_module(make, input_ids=ids, labels=ids)
