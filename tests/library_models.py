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
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
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
        loss=_ce_loss,
        resized=resized,
        checkpointing=checkpointing,
        has_dropout=has_dropout,
    )


def _ce_loss(out: torch.Tensor) -> torch.Tensor:
    target = torch.arange(out.shape[0]) % CLASSES
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


def vit(dropout: float = 0.0) -> Case:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "test_vit",
        img_size=IMAGE,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        num_classes=CLASSES,
        drop_rate=dropout,
        proj_drop_rate=dropout,
        attn_drop_rate=dropout,
        drop_path_rate=dropout,
    )
    return _vision_case("vit", "timm", model, _timm_checkpointing)


def convnext(dropout: float = 0.0) -> Case:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "test_convnext",
        depths=(1, 1, 1, 1),
        dims=(8, 16, 24, 32),
        num_classes=CLASSES,
        drop_rate=dropout,
        drop_path_rate=dropout,
    )
    return _vision_case("convnext", "timm", model, _timm_checkpointing)


def efficientnet(dropout: float = 0.0) -> Case:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "test_efficientnet", num_classes=CLASSES, drop_rate=dropout, drop_path_rate=dropout
    )
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
    for i in range(start, len(seq)):
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
}


def build(name: str, dropout: float = 0.0) -> Case:
    return BUILDERS[name](dropout)
