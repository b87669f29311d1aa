"""``aotgrad.scan_layers`` against the unrolled loop of layers: values and every ``.grad``."""

from __future__ import annotations

import copy
import re

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


# ------------------------------------------------ decoder stacks with extra arguments


def _decoder_stack(name):
    """A 3-layer random-config transformers stack, its input hidden state, the arguments its
    model's forward gives every layer (built as that forward builds them), and the check that
    the stack's output, through the final norm, is the model's own output."""
    import library_models  # noqa: F401  (the torchvision shim, before transformers)

    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3)
    common.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "mistral": lambda: transformers.MistralConfig(**common, head_dim=8, sliding_window=4),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2
        ),
        "gpt2_scaled_by_layer": lambda: transformers.GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=32,
            n_layer=3,
            n_head=2,
            scale_attn_by_inverse_layer_idx=True,
        ),
    }[name]()
    config.use_cache = False
    model = transformers.AutoModel.from_config(config)
    model.train()  # dropout probabilities are 0 in these configs but for gpt2's: set below
    batch, seq = 2, 6
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq // 2 :] = 0  # padding: the mask must act
    ids = torch.randint(1, 64, (batch, seq))
    position_ids = torch.arange(seq).unsqueeze(0)
    if name.startswith("gpt2"):
        model.eval()  # no dropout: eager and scan draw the same
        hidden = model.wte(ids) + model.wpe(position_ids)
        causal = create_causal_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        # GPT2Model.forward's call: block(h, past_key_values, mask, encoder_hidden_states, ...)
        args = (None, causal, None)
        kwargs = {"encoder_attention_mask": None, "use_cache": False, "position_ids": position_ids}
        return (
            model.h,
            hidden.detach(),
            args,
            kwargs,
            _is_model_output(model, model.ln_f, ids, mask),
        )
    hidden = model.embed_tokens(ids)
    make_mask = create_sliding_window_causal_mask if name == "mistral" else create_causal_mask
    causal = make_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=mask,
        past_key_values=None,
        position_ids=position_ids,
    )
    kwargs = {
        "attention_mask": causal,
        "position_embeddings": model.rotary_emb(hidden, position_ids=position_ids),
        "position_ids": position_ids,
        "past_key_values": None,
        "use_cache": False,
    }
    return model.layers, hidden.detach(), (), kwargs, _is_model_output(model, model.norm, ids, mask)


def _is_model_output(model, norm, ids, mask):
    def check(hidden):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(norm(hidden), want, rtol=1e-4, atol=1e-5)

    return check


def _through(layers, hidden, args, kwargs):
    for layer in layers:
        out = layer(hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama", {}),
        ("llama", {"checkpoint": True, "partition": "mincut"}),
        ("qwen2", {}),
        ("mistral", {}),
        ("gpt2", {}),
    ],
)
def test_decoder_stacks_with_masks_and_position_embeddings(name, options):
    """Values and every grad (parameters, hidden state, position embeddings) equal eager's
    unrolled loop; the body is captured once for the three layers."""
    layers, hidden, args, kwargs, is_model_output = _decoder_stack(name)
    if "position_embeddings" in kwargs:  # grads must reach extra tensors too
        kwargs["position_embeddings"] = tuple(
            t.detach().clone().requires_grad_() for t in kwargs["position_embeddings"]
        )
    twin = copy.deepcopy(layers)
    twin_kwargs = {
        k: tuple(t.detach().clone().requires_grad_() for t in v)
        if k == "position_embeddings"
        else v
        for k, v in kwargs.items()
    }
    x, x_twin = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    want = _through(twin, x_twin, args, twin_kwargs)
    got = aotgrad.scan_layers(layers, x, *args, layer_kwargs=kwargs, **options)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    is_model_output(got)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for (n, p), q in zip(layers.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, q.grad, msg=n, **tol)
    torch.testing.assert_close(x.grad, x_twin.grad, **tol)
    if "position_embeddings" in kwargs:
        for a, b in zip(
            kwargs["position_embeddings"], twin_kwargs["position_embeddings"], strict=True
        ):
            assert a.grad is not None and a.grad.abs().sum() > 0
            torch.testing.assert_close(a.grad, b.grad, **tol)
    run = aotgrad.scan_layers_function(layers, *args, layer_kwargs=kwargs, **options)
    assert run.captures == 1
    names = [str(d) for d in run.traced.signature.forward_inputs]
    assert names[0] == "carry" and names[1].startswith("x[0][")
    mask_name = "x[1]['args[1]']" if name == "gpt2" else "x[1]['attention_mask']"
    assert mask_name in names
    h2 = hidden.clone().requires_grad_()
    two = aotgrad.scan_layers(layers[:2], h2, *args, layer_kwargs=kwargs, **options)
    torch.testing.assert_close(two, _through(twin[:2], hidden, args, twin_kwargs), **tol)
    assert run.captures == 1


def test_extra_constants_key_the_body():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, h, mask, scale=1.0, use_cache=False):
            assert use_cache is False
            return (self.fc(h) * mask * scale, "dropped")

    layers = nn.ModuleList(Scaled() for _ in range(3))
    x, mask = torch.randn(2, 3), torch.rand(3)
    for scale in (1.0, 2.0, 2.0):
        got = aotgrad.scan_layers(layers, x, mask, layer_kwargs={"scale": scale})
        torch.testing.assert_close(got, _through(layers, x, (mask,), {"scale": scale}))
    assert aotgrad.scan_layers_function(layers, mask, layer_kwargs={"scale": 2.0}).captures == 1


def test_layer_keywords_are_not_options():
    layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
    with pytest.raises(TypeError, match=r"layer_kwargs=\{'attention_mask': \.\.\.\}"):
        aotgrad.scan_layers(layers, torch.randn(2, 3), attention_mask=torch.ones(3))


def test_extra_objects_are_refused():
    class Cache:
        pass

    layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
    with pytest.raises(aotgrad.ScanError, match=r"layer_kwargs\['past_key_values'\] is a Cache"):
        aotgrad.scan_layers(layers, torch.randn(2, 3), layer_kwargs={"past_key_values": Cache()})


def test_a_first_output_of_another_shape_is_refused():
    class Widen(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, h, mask):
            return self.fc(h) * mask, None

    layers = nn.ModuleList(Widen() for _ in range(2))
    with pytest.raises(aotgrad.ScanError, match="carry"):
        aotgrad.scan_layers(layers, torch.randn(2, 3), torch.ones(4))


def test_a_result_without_the_hidden_state_is_refused():
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, h, mask):
            return {"hidden": self.fc(h) * mask}

    layers = nn.ModuleList(Named() for _ in range(2))
    with pytest.raises(aotgrad.ScanError, match="returned dict"):
        aotgrad.scan_layers(layers, torch.randn(2, 3), torch.ones(3))


def test_settings_that_differ_between_layers_are_refused_when_read():
    """GPT-2 with scale_attn_by_inverse_layer_idx scales each layer's attention by
    1 / (layer_idx + 1) (its attn.scaling): layer 0's code would use layer 0's for every
    layer. Llama's layer_idx (read only with a cache) differs too, and its stacks run above."""
    layers, hidden, args, kwargs, _ = _decoder_stack("gpt2_scaled_by_layer")
    with pytest.raises(
        aotgrad.ScanError, match=r"attn\.scaling, which is 0.25 on layer 0 but 0.125 on layer 1"
    ):
        aotgrad.scan_layers(layers, hidden, *args, layer_kwargs=kwargs)
    with pytest.raises(aotgrad.ScanError, match="scaling"):  # the capture is kept: again
        aotgrad.scan_layers(layers, hidden, *args, layer_kwargs=kwargs)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    assert type(layers[0].attn) is GPT2Attention  # the recording class is gone


def test_a_differing_eps_is_refused():
    layers = nn.ModuleList([nn.LayerNorm(4), nn.LayerNorm(4), nn.LayerNorm(4, eps=0.1)])
    with pytest.raises(
        aotgrad.ScanError, match=r"eps, which is 1e-05 on layer 0 but 0.1 on layer 2"
    ):
        aotgrad.scan_layers(layers, torch.randn(2, 4))
    assert type(layers[0]) is nn.LayerNorm  # the recording class is gone after the capture


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h, gate, scale=1.0):
        return self.fc(h) * gate * scale


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (lambda layers, gate: ((), {}), r"extra arguments \(\) here, \(args\[0\], scale=0\.5\)"),
        (
            lambda layers, gate: ((gate,), {"layer_kwargs": {"scale": 2.0}}),
            r"\(args\[0\], scale=2\.0\) here, \(args\[0\], scale=0\.5\) in the scan",
        ),
        (
            lambda layers, gate: ((gate,), {"layer_kwargs": {"scale": 0.5}, "checkpoint": True}),
            "checkpoint=True here, False in the scan",
        ),
        (
            lambda layers, gate: ((gate,), {"layer_kwargs": {"scale": 0.5}, "partition": "mincut"}),
            "options differ from the scan's: partition",
        ),
    ],
)
def test_traced_after_the_scan_says_what_differs(given, said):
    layers = nn.ModuleList(_Gated() for _ in range(3))
    gate = torch.rand(4)
    aotgrad.scan_layers(layers, torch.randn(2, 4), gate, layer_kwargs={"scale": 0.5})
    args, keywords = given(layers, gate)
    run = aotgrad.scan_layers_function(layers, *args, **keywords)
    with pytest.raises(aotgrad.errors.ScanError, match="scan_layers ran these layers") as caught:
        run.traced  # noqa: B018
    message = str(caught.value)
    assert re.search(said, message) and "call the scan first" not in message
    assert f"{__file__}:" in message  # the user's line
    same = aotgrad.scan_layers_function(layers, gate, layer_kwargs={"scale": 0.5})
    assert same.traced.signature.forward_inputs[-1].path == "x[1]['args[0]']"


def test_traced_before_any_scan_says_to_run_it():
    layers = nn.ModuleList(_Gated() for _ in range(2))
    layers.eval()
    with pytest.raises(aotgrad.errors.ScanError, match="has not run these layers yet"):
        aotgrad.scan_layers_function(layers, torch.rand(4)).traced  # noqa: B018
    with pytest.raises(aotgrad.errors.ScanError, match="not been captured") as caught:
        aotgrad.scan_function(lambda c, x: (c + x, None)).traced  # noqa: B018
    assert f"{__file__}:" in str(caught.value)
