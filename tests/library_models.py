"""Small library models from random configs, for the real-model suite (nothing is downloaded).

Each builder returns a :class:`Case`: the model (train mode), example inputs, a loss function
on the model's output, a way to make inputs of another batch / sequence size (for
``dynamic=True``) and a way to turn gradient checkpointing on. Sizes are tiny (hidden 32,
1-2 layers, 32x32 images, batch 2) so one check takes seconds; ``dropout`` builds the same
model with dropout probabilities above zero.

torchvision needs a shim. PyPI's torchvision 0.28.0 is the release matching torch 2.13.0, but
its C++ extension (``torchvision._C``: nms, roi_align, deform_conv, ...) is built against the
CUDA torch; with the CPU torch, importing ``torchvision._meta_registrations`` (which registers
fake kernels for those ops) fails and takes ``import torchvision`` with it. Its classification
models are pure Python over ordinary aten ops and never touch those ops, so we register an
empty module under that name before the import (transformers imports torchvision too, so this happens when this
module is imported); anything that needs the missing C++ ops
would still fail loudly.

``HF_HUB_OFFLINE=1`` is set before transformers is imported: configs are built in code, and
nothing may reach the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Before anything imports torchvision: transformers and timm do, when it is installed.
_SHIM = "torchvision._meta_registrations"
sys.modules.setdefault(_SHIM, types.ModuleType(_SHIM))

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

BATCH, SEQ, IMAGE = 2, 8, 32
# The second size the dynamic check calls with.
BATCH2, SEQ2 = 3, 6
VOCAB, CLASSES = 64, 10


@dataclass(frozen=True)
class Case:
    """One model ready to check: call ``model(*args, **kwargs)``, then ``loss(output)``."""

    name: str
    family: str  # "transformers", "timm" or "torchvision"
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]
    # Inputs at another (batch, sequence) size: the dynamic check's second call.
    resized: Callable[[int, int], Inputs]
    # Turns gradient checkpointing on (argument: use_reentrant); the check runs inside.
    checkpointing: Callable[[nn.Module, bool], contextlib.AbstractContextManager[None]]
    has_dropout: bool = True

    @property
    def inputs(self) -> Inputs:
        return self.args, self.kwargs


def import_torchvision() -> Any:
    """``import torchvision`` with the CPU torch (the shim above; see the module docstring)."""
    import torchvision

    return torchvision


# ---------------------------------------------------------------- transformers


def _tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100 * batch + seq)
    return torch.randint(1, VOCAB, (batch, seq), generator=g)


def _mask(batch: int, seq: int) -> torch.Tensor:
    """Attention mask with padding at the end of the last sequence (the mask code must act)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq // 2 :] = 0
    return mask


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


@contextlib.contextmanager
def _hf_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    model.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    yield


def _hf_case(
    name: str, model: nn.Module, make: Callable[[int, int], Inputs], dropout: float
) -> Case:
    _quiet_transformers()
    model.train()
    args, kwargs = make(BATCH, SEQ)
    return Case(
        name=name,
        family="transformers",
        model=model,
        args=args,
        kwargs=kwargs,
        loss=_hf_loss,
        resized=make,
        checkpointing=_hf_checkpointing,
    )


def gpt2(dropout: float = 0.0) -> Case:
    """GPT-2 LM head model with labels; its ``lm_head`` is tied to ``wte`` (the tie is checked)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config)

    def make(batch: int, seq: int) -> Inputs:
        ids = _tokens(batch, seq)
        return (), {"input_ids": ids, "labels": ids}

    return _hf_case("gpt2", model, make, dropout)


def bert(dropout: float = 0.0) -> Case:
    """BERT sequence classification with a padding attention mask and labels."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
        num_labels=3,
    )
    model = BertForSequenceClassification(config)

    def make(batch: int, seq: int) -> Inputs:
        labels = torch.arange(batch) % 3
        return (), {
            "input_ids": _tokens(batch, seq),
            "attention_mask": _mask(batch, seq),
            "labels": labels,
        }

    return _hf_case("bert", model, make, dropout)


def t5(dropout: float = 0.0) -> Case:
    """T5 encoder-decoder: attention mask, explicit decoder inputs and labels."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    model = T5ForConditionalGeneration(config)

    def make(batch: int, seq: int) -> Inputs:
        labels = _tokens(batch, seq - 2, seed=1)
        decoder_ids = torch.cat([torch.zeros(batch, 1, dtype=torch.long), labels[:, :-1]], 1)
        kwargs = {
            "input_ids": _tokens(batch, seq),
            "attention_mask": _mask(batch, seq),
            "decoder_input_ids": decoder_ids,
            "labels": labels,
        }
        return (), kwargs

    return _hf_case("t5", model, make, dropout)


def llama(dropout: float = 0.0) -> Case:
    """One-layer Llama (grouped-query attention, rotary embeddings) with labels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attention_dropout=dropout,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)

    def make(batch: int, seq: int) -> Inputs:
        ids = _tokens(batch, seq)
        return (), {"input_ids": ids, "labels": ids}

    return _hf_case("llama", model, make, dropout)


def _causal_make(batch: int, seq: int) -> Inputs:
    ids = _tokens(batch, seq)
    return (), {"input_ids": ids, "attention_mask": _mask(batch, seq), "labels": ids}


def roberta(dropout: float = 0.0) -> Case:
    """RoBERTa masked LM: padding mask, explicit token type ids, labels with ignored (-100) slots."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=1,
    )
    model = RobertaForMaskedLM(config)

    def make(batch: int, seq: int) -> Inputs:
        ids = _tokens(batch, seq) + 2  # ids 0, 1 are special; position ids skip the padding
        mask = _mask(batch, seq)
        ids = ids.clamp(max=VOCAB - 1).masked_fill(mask == 0, 1)
        labels = ids.masked_fill(torch.arange(seq) % 3 != 0, -100)
        token_types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq)
        return (), {
            "input_ids": ids,
            "attention_mask": mask,
            "token_type_ids": token_types,
            "labels": labels,
        }

    return _hf_case("roberta", model, make, dropout)


def distilbert(dropout: float = 0.0) -> Case:
    """DistilBERT sequence classification with a padding mask and labels."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_position_embeddings=32,
        dropout=dropout,
        attention_dropout=dropout,
        seq_classif_dropout=dropout,
        num_labels=3,
    )
    model = DistilBertForSequenceClassification(config)

    def make(batch: int, seq: int) -> Inputs:
        return (), {
            "input_ids": _tokens(batch, seq),
            "attention_mask": _mask(batch, seq),
            "labels": torch.arange(batch) % 3,
        }

    return _hf_case("distilbert", model, make, dropout)


def gpt2_cls(dropout: float = 0.0) -> Case:
    """GPT-2 sequence classification: the last non-pad token is found by ``argmax`` and gathered."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        pad_token_id=0,
        num_labels=3,
        use_cache=False,
    )
    model = GPT2ForSequenceClassification(config)

    def make(batch: int, seq: int) -> Inputs:
        mask = _mask(batch, seq)
        ids = _tokens(batch, seq).masked_fill(mask == 0, 0)
        return (), {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(batch) % 3}

    return _hf_case("gpt2_cls", model, make, dropout)


def bart(dropout: float = 0.0) -> Case:
    """BART encoder-decoder: labels shifted into decoder inputs inside the model, learned positions."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        use_cache=False,
    )
    model = BartForConditionalGeneration(config)

    def make(batch: int, seq: int) -> Inputs:
        return (), {
            "input_ids": _tokens(batch, seq),
            "attention_mask": _mask(batch, seq),
            "labels": _tokens(batch, seq - 2, seed=1),
        }

    return _hf_case("bart", model, make, dropout)


def mistral(dropout: float = 0.0) -> Case:
    """Mistral with a sliding window shorter than the sequence, GQA, rotary, padding mask."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        sliding_window=4,
        attention_dropout=dropout,
        use_cache=False,
    )
    return _hf_case("mistral", MistralForCausalLM(config), _causal_make, dropout)


def qwen2(dropout: float = 0.0) -> Case:
    """Qwen2: biased q/k/v projections, GQA, rotary, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        attention_dropout=dropout,
        use_cache=False,
    )
    return _hf_case("qwen2", Qwen2ForCausalLM(config), _causal_make, dropout)


def opt(dropout: float = 0.0) -> Case:
    """OPT: learned positions computed from the attention mask (cumsum), pre-LN, ReLU."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
        dropout=dropout,
        attention_dropout=dropout,
        layerdrop=0.0,
        use_cache=False,
    )
    return _hf_case("opt", OPTForCausalLM(config), _causal_make, dropout)


def gpt_neox(dropout: float = 0.0) -> Case:
    """GPT-NeoX: partial rotary, parallel residual, fused qkv."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        rotary_pct=0.5,
        max_position_embeddings=32,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_cache=False,
    )
    return _hf_case("gpt_neox", GPTNeoXForCausalLM(config), _causal_make, dropout)


def _mixtral(name: str, experts: str | None, dropout: float) -> Case:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        attention_dropout=dropout,
        use_cache=False,
    )
    kwargs = {} if experts is None else {"experts_implementation": experts}
    model = MixtralForCausalLM._from_config(config, **kwargs)
    return _hf_case(name, model, _causal_make, dropout)


def mixtral(dropout: float = 0.0) -> Case:
    """Mixtral MoE, the default experts kernel: top-2 routing, router aux loss in the loss."""
    return _mixtral("mixtral", None, dropout)


def mixtral_eager(dropout: float = 0.0) -> Case:
    """Mixtral MoE, ``experts_implementation="eager"``: a Python loop over ``nonzero()`` experts."""
    return _mixtral("mixtral_eager", "eager", dropout)


def whisper(dropout: float = 0.0) -> Case:
    """Whisper: a conv1d frontend over log-mel features, sinusoidal positions, decoder with labels."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        use_cache=False,
    )
    model = WhisperForConditionalGeneration(config)

    def make(batch: int, seq: int) -> Inputs:
        g = torch.Generator().manual_seed(batch)
        features = torch.randn(batch, 8, 32, generator=g)  # 2 * max_source_positions frames
        return (), {"input_features": features, "labels": _tokens(batch, seq, seed=1)}

    return _hf_case("whisper", model, make, dropout)


# ---------------------------------------------------------------- vision


def _images(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + batch)
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=g), torch.arange(batch) % CLASSES


def _vision_case(
    name: str,
    family: str,
    model: nn.Module,
    checkpointing: Callable[[nn.Module, bool], contextlib.AbstractContextManager[None]],
    has_dropout: bool = True,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> Case:
    model.train()
    images, _ = _images(BATCH)

    def resized(batch: int, seq: int) -> Inputs:
        return (_images(batch)[0],), {}

    return Case(
        name=name,
        family=family,
        model=model,
        args=(images,),
        kwargs={},
        loss=_ce_loss if loss is None else loss,
        resized=resized,
        checkpointing=checkpointing,
        has_dropout=has_dropout,
    )


def _ce_loss(out: torch.Tensor) -> torch.Tensor:
    target = torch.arange(out.shape[0], device=out.device) % CLASSES
    return F.cross_entropy(out, target)


@contextlib.contextmanager
def _timm_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    """timm reads the reentrant flag from a global at call time: set it for the check's duration."""
    from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt

    model.set_grad_checkpointing(True)  # type: ignore[operator]
    before = use_reentrant_ckpt()
    set_reentrant_ckpt(reentrant)
    try:
        yield
    finally:
        set_reentrant_ckpt(before)


def _timm(name: str, dropout: float, attention: bool = False, **config: Any) -> nn.Module:
    """A timm model from ``config``, seeded, with ``dropout`` as its drop rates (also the
    attention and projection ones when ``attention``)."""
    import timm

    torch.manual_seed(0)
    rates = {"drop_rate": dropout, "drop_path_rate": dropout}
    if attention:
        rates |= {"proj_drop_rate": dropout, "attn_drop_rate": dropout}
    return timm.create_model(name, num_classes=CLASSES, **config, **rates)


def vit(dropout: float = 0.0) -> Case:
    model = _timm(
        "test_vit",
        dropout,
        attention=True,
        img_size=IMAGE,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
    )
    return _vision_case("vit", "timm", model, _timm_checkpointing)


def convnext(dropout: float = 0.0) -> Case:
    model = _timm("test_convnext", dropout, depths=(1, 1, 1, 1), dims=(8, 16, 24, 32))
    return _vision_case("convnext", "timm", model, _timm_checkpointing)


def efficientnet(dropout: float = 0.0) -> Case:
    model = _timm("test_efficientnet", dropout)
    return _vision_case("efficientnet", "timm", model, _timm_checkpointing)


class Checkpointed(nn.Module):
    """Runs ``block`` under ``torch.utils.checkpoint`` (torchvision has no switch of its own)."""

    def __init__(self, block: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant)


def _wrap_blocks(seq: nn.Sequential, reentrant: bool, start: int = 0) -> None:
    """Checkpoint each composite block of ``seq`` from ``start`` on.

    Single layers stay outside: an in-place ``ReLU`` checkpointed on its own modifies the
    output of the checkpoint before it, which eager's backward refuses too.
    """
    for i in range(start, len(seq)):
        if next(seq[i].children(), None) is not None:
            seq[i] = Checkpointed(seq[i], reentrant)


@contextlib.contextmanager
def _resnet_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        _wrap_blocks(layer, reentrant)  # type: ignore[arg-type]
    yield


@contextlib.contextmanager
def _mobilenet_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    # Not block 0: its input is the image, which does not require grad, so a reentrant
    # checkpoint there would give its parameters no gradient (in eager too).
    _wrap_blocks(model.features, reentrant, start=1)  # type: ignore[arg-type]
    yield


def resnet18(dropout: float = 0.0) -> Case:
    """torchvision ResNet-18 (BatchNorm: running stats are compared); it has no dropout."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=CLASSES)
    return _vision_case("resnet18", "torchvision", model, _resnet_checkpointing, has_dropout=False)


def mobilenet_v3(dropout: float = 0.0) -> Case:
    """torchvision MobileNetV3-small: in-place hardswish/hardsigmoid, squeeze-excite, BatchNorm."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.mobilenet_v3_small(num_classes=CLASSES, dropout=dropout)
    return _vision_case("mobilenet_v3", "torchvision", model, _mobilenet_checkpointing)


@contextlib.contextmanager
def _tv_vit_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    _wrap_blocks(model.encoder.layers, reentrant)  # type: ignore[arg-type]
    yield


def tv_vit(dropout: float = 0.0) -> Case:
    """torchvision VisionTransformer: ``nn.MultiheadAttention(batch_first=True)`` with dropout."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.VisionTransformer(
        image_size=IMAGE,
        patch_size=8,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        dropout=dropout,
        attention_dropout=dropout,
        num_classes=CLASSES,
    )
    return _vision_case("tv_vit", "torchvision", model, _tv_vit_checkpointing)


def swin(dropout: float = 0.0) -> Case:
    """timm Swin: shifted windows (``roll``), relative position bias index buffers, patch merging."""
    model = _timm(
        "swin_tiny_patch4_window7_224",
        dropout,
        attention=True,
        img_size=IMAGE,
        patch_size=4,
        window_size=4,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(1, 2),
    )
    return _vision_case("swin", "timm", model, _timm_checkpointing)


def _distilled_loss(out: Any) -> torch.Tensor:
    logits, distilled = out
    return _ce_loss(logits) + 0.5 * _ce_loss(distilled)


def deit(dropout: float = 0.0) -> Case:
    """timm DeiT with a distillation token, in distilled training (two heads, a tuple output)."""
    model = _timm(
        "deit_tiny_distilled_patch16_224",
        dropout,
        attention=True,
        img_size=IMAGE,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
    )
    model.set_distilled_training(True)  # type: ignore[operator]
    return _vision_case("deit", "timm", model, _timm_checkpointing, loss=_distilled_loss)


def mobilevit(dropout: float = 0.0) -> Case:
    """timm MobileViT-XXS: convolutions and transformers over unfolded 2x2 patches, BatchNorm."""
    model = _timm("mobilevit_xxs", dropout)
    return _vision_case("mobilevit", "timm", model, _timm_checkpointing)


def regnet(dropout: float = 0.0) -> Case:
    """timm RegNetY-200MF: grouped convolutions, squeeze-excite, BatchNorm, stochastic depth."""
    model = _timm("regnety_002", dropout)
    return _vision_case("regnet", "timm", model, _timm_checkpointing)


def coat(dropout: float = 0.0) -> Case:
    """timm CoaT-Lite: one convolutional position encoding module shared by every serial block
    of a stage (a submodule registered under two names), conv relative position attention."""
    model = _timm(
        "coat_lite_tiny",
        dropout,
        attention=True,
        img_size=IMAGE,
        embed_dims=(16, 16, 32, 32),
        serial_depths=(1, 1, 1, 1),
        num_heads=2,
        mlp_ratios=(2, 2, 2, 2),
        crpe_window={1: 1, 3: 1},
    )
    return _vision_case("coat", "timm", model, _timm_checkpointing)


@contextlib.contextmanager
def _features_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    _wrap_blocks(model.features, reentrant, start=1)  # type: ignore[arg-type]
    yield


def densenet(dropout: float = 0.0) -> Case:
    """torchvision DenseNet: concatenation of every earlier feature map, BatchNorm; its
    ``memory_efficient`` mode is the checkpointing (non-reentrant, inside each dense layer)."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.DenseNet(
        growth_rate=8,
        block_config=(2, 2),
        num_init_features=16,
        bn_size=2,
        drop_rate=dropout,
        num_classes=CLASSES,
    )
    return _vision_case("densenet", "torchvision", model, _features_checkpointing)


def squeezenet(dropout: float = 0.0) -> Case:
    """torchvision SqueezeNet 1.1: fire modules (concatenated expand branches), ceil-mode pooling."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.squeezenet1_1(num_classes=CLASSES, dropout=dropout)
    return _vision_case("squeezenet", "torchvision", model, _features_checkpointing)


@contextlib.contextmanager
def _shufflenet_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    for stage in (model.stage2, model.stage3, model.stage4):
        _wrap_blocks(stage, reentrant)  # type: ignore[arg-type]
    yield


def shufflenet(dropout: float = 0.0) -> Case:
    """torchvision ShuffleNetV2: channel shuffle (view, transpose, view), split branches; no dropout."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.ShuffleNetV2(
        stages_repeats=[2, 1, 1], stages_out_channels=[8, 16, 32, 64, 64], num_classes=CLASSES
    )
    return _vision_case(
        "shufflenet", "torchvision", model, _shufflenet_checkpointing, has_dropout=False
    )


@contextlib.contextmanager
def _tv_regnet_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    for stage in model.trunk_output:  # type: ignore[union-attr]
        _wrap_blocks(stage, reentrant)
    yield


def tv_regnet(dropout: float = 0.0) -> Case:
    """torchvision RegNetY: grouped convolutions with squeeze-excite; no dropout."""
    tv = import_torchvision()
    torch.manual_seed(0)
    params = tv.models.regnet.BlockParams.from_init_params(
        depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25
    )
    model = tv.models.RegNet(params, num_classes=CLASSES, stem_width=16)
    return _vision_case(
        "tv_regnet", "torchvision", model, _tv_regnet_checkpointing, has_dropout=False
    )


@contextlib.contextmanager
def _tv_swin_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    for stage in model.features[1::2]:  # type: ignore[index]
        _wrap_blocks(stage, reentrant)
    yield


def tv_swin(dropout: float = 0.0) -> Case:
    """torchvision Swin: shifted windows with an attention mask built from slices, stochastic depth."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[1, 2],
        window_size=[4, 4],
        dropout=dropout,
        attention_dropout=dropout,
        stochastic_depth_prob=dropout,
        num_classes=CLASSES,
    )
    return _vision_case("tv_swin", "torchvision", model, _tv_swin_checkpointing)


def tv_efficientnet(dropout: float = 0.0) -> Case:
    """torchvision EfficientNet-B0 at width/depth 0.25: MBConv, squeeze-excite, stochastic depth."""
    tv = import_torchvision()
    from torchvision.models.efficientnet import _efficientnet_conf

    torch.manual_seed(0)
    setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    model = tv.models.EfficientNet(
        setting,
        dropout=dropout,
        stochastic_depth_prob=dropout,
        num_classes=CLASSES,
        last_channel=last,
    )
    return _vision_case("tv_efficientnet", "torchvision", model, _features_checkpointing)


@contextlib.contextmanager
def _mnasnet_checkpointing(model: nn.Module, reentrant: bool) -> Iterator[None]:
    _wrap_blocks(model.layers, reentrant, start=8)  # type: ignore[arg-type]
    yield


def mnasnet(dropout: float = 0.0) -> Case:
    """torchvision MNASNet at alpha 0.25: depthwise separable stacks, BatchNorm, dropout head."""
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.MNASNet(alpha=0.25, num_classes=CLASSES, dropout=dropout)
    return _vision_case("mnasnet", "torchvision", model, _mnasnet_checkpointing)


BUILDERS: dict[str, Callable[..., Case]] = {
    "gpt2": gpt2,
    "bert": bert,
    "t5": t5,
    "llama": llama,
    "vit": vit,
    "convnext": convnext,
    "efficientnet": efficientnet,
    "resnet18": resnet18,
    "mobilenet_v3": mobilenet_v3,
    "tv_vit": tv_vit,
    "roberta": roberta,
    "distilbert": distilbert,
    "gpt2_cls": gpt2_cls,
    "bart": bart,
    "mistral": mistral,
    "qwen2": qwen2,
    "opt": opt,
    "gpt_neox": gpt_neox,
    "mixtral": mixtral,
    "mixtral_eager": mixtral_eager,
    "whisper": whisper,
    "swin": swin,
    "deit": deit,
    "mobilevit": mobilevit,
    "regnet": regnet,
    "coat": coat,
    "densenet": densenet,
    "squeezenet": squeezenet,
    "shufflenet": shufflenet,
    "tv_regnet": tv_regnet,
    "tv_swin": tv_swin,
    "tv_efficientnet": tv_efficientnet,
    "mnasnet": mnasnet,
}


def build(name: str, dropout: float = 0.0) -> Case:
    return BUILDERS[name](dropout)


def on_device(case: Case, device: str | torch.device) -> Case:
    """``case`` with its model, inputs and resized inputs on ``device`` (``tests/gpu_checks.py``).

    The model moves in place (``nn.Module.to``), as a user's ``model.cuda()`` does; the losses
    make their targets on the output's device.
    """

    def move(inputs: Inputs) -> Inputs:
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), inputs)

    args, kwargs = move(case.inputs)
    return dataclasses.replace(
        case,
        model=case.model.to(device),
        args=args,
        kwargs=kwargs,
        resized=lambda batch, seq: move(case.resized(batch, seq)),
    )
