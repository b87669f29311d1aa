"""Plain objects holding tensors among the outputs (Note [Objects among the outputs])."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

import aotgrad


class Pair:
    def __init__(self, a, b, tag):
        self.a, self.b, self.tag = a, b, tag


class Holder:
    def __init__(self, pairs):
        self.pairs = pairs
        self.kind = Pair  # a class: a constant, kept by reference


def test_an_object_holding_tensors_is_rebuilt_from_the_graphs_outputs():
    def f(x):
        return x.sum(), Holder([Pair(x.sin(), x.cos(), "first"), Pair(x * 2, None, "second")])

    x = torch.randn(3, requires_grad=True)
    compiled = aotgrad.aot_function(f)
    _, holder = compiled(x)
    expected = f(x)[1]
    assert type(holder) is Holder and holder.kind is Pair
    assert [type(p) for p in holder.pairs] == [Pair, Pair]
    assert [p.tag for p in holder.pairs] == ["first", "second"] and holder.pairs[1].b is None
    for got, want in zip(holder.pairs, expected.pairs, strict=True):
        torch.testing.assert_close(got.a, want.a)
    holder.pairs[0].a.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
    again = compiled(x)[1]  # a new object each call, as eager makes
    assert again is not holder and again.pairs[0].a is not holder.pairs[0].a
    traced = aotgrad.trace(f, x)
    assert "output[1].pairs[0].a" in str(traced.signature)


def test_an_object_reached_twice_is_refused():
    def f(x):
        pair = Pair(x.sin(), x.cos(), "shared")
        return pair, pair

    with pytest.raises(aotgrad.UnsupportedOutputError, match="Pair object holding tensors twice"):
        aotgrad.aot_function(f)(torch.randn(3))


def test_an_object_without_tensors_is_still_refused():
    with pytest.raises(aotgrad.UnsupportedOutputError, match="Pair"):
        aotgrad.aot_function(lambda x: (x.sin(), Pair(1, 2, "no tensors")))(torch.randn(3))


def _transformers():
    # torchvision's C++ ops are missing with the CPU torch; transformers imports it
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2():
    t = _transformers()
    config = t.GPT2Config(  # default use_cache=True and dropout 0.1
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return t.GPT2LMHeadModel(config)


def _llama():
    t = _transformers()
    config = t.LlamaConfig(  # default use_cache=True
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return t.LlamaForCausalLM(config)


def _aot_module(model):
    return aotgrad.aot_module(model)


def _traced(model):
    ids = torch.zeros(2, 8, dtype=torch.long)
    return aotgrad.trace(model, input_ids=ids, labels=ids)


def _dynamo(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="aotgrad")


@pytest.mark.parametrize("frontend", [_aot_module, _traced, _dynamo])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("make", [_gpt2, _llama])
def test_a_causal_lm_returning_its_cache_matches_eager(make, train, frontend):
    torch.manual_seed(0)
    model = make().train(train)
    assert model.config.use_cache
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    expected = twin(input_ids=ids, labels=ids)
    compiled = frontend(model)
    torch.manual_seed(1)
    got = compiled(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)
    cache, eager_cache = got.past_key_values, expected.past_key_values
    assert type(cache) is type(eager_cache)
    assert cache.get_seq_length() == eager_cache.get_seq_length() == 8
    assert len(cache.layers) == len(eager_cache.layers) == 2
    for layer, eager_layer in zip(cache.layers, eager_cache.layers, strict=True):
        assert type(layer) is type(eager_layer)
        torch.testing.assert_close(layer.keys, eager_layer.keys)
        torch.testing.assert_close(layer.values, eager_layer.values)
    got.loss.backward()
    expected.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
