"""Kernels that resize an input before writing it (Note [Eager sizes of resizing kernels],
Note [Inputs a kernel resizes]): a QAT model's per-channel fused observers, as eager runs them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import aotgrad


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4 * 6 * 6, 5)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x):
        x = self.relu(self.conv(self.quant(x)))
        return self.dequant(self.fc(x.flatten(1)))


def _qat_model() -> nn.Module:
    torch.manual_seed(0)
    model = _Small().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        torch.ao.quantization.prepare_qat(model, inplace=True)
    return model


_global_model: nn.Module | None = None


def _loss(x):
    assert _global_model is not None
    return _global_model(x).square().mean()


def _compiled(how: str, model: nn.Module):
    global _global_model
    if how == "aot_module":
        return lambda x: aotgrad.aot_module(model)(x).square().mean()
    _global_model = model
    return aotgrad.aot_function(_loss)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["aot_module", "global_loss"])
def test_qat_fused_fake_quant_runs_as_eager(how):
    model = _qat_model()
    ref = copy.deepcopy(model)
    scale = "conv.weight_fake_quant.scale"
    assert model.state_dict()[scale].shape == (1,)  # resized to one per channel at the first call
    compiled = _compiled(how, model)
    for step in range(3):
        x = torch.randn(2, 3, 8, 8)
        model.zero_grad()
        ref.zero_grad()
        loss = compiled(x)
        loss.backward()
        want = ref(x).square().mean()
        want.backward()
        torch.testing.assert_close(loss, want)
        got_state, want_state = _state(model), _state(ref)
        assert got_state.keys() == want_state.keys()
        for name, value in want_state.items():  # buffers (observers' state) and parameters
            torch.testing.assert_close(got_state[name], value, msg=f"step {step}: {name}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: grad of {name}")
    assert model.state_dict()[scale].shape == (4,)


@pytest.mark.parametrize("keep", [False, True], ids=["epilogue", "keep_in_graph"])
def test_qat_inference_resizes_the_observers_as_eager(keep):
    """No backward: with keep_inference_input_mutations the resized observers stay out of the
    graph (Note [Mutations kept in the graph]) and are resized by the epilogue."""
    model = _qat_model()
    ref = copy.deepcopy(model)
    compiled = aotgrad.aot_module(model, keep_inference_input_mutations=keep)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 8, 8)
            torch.testing.assert_close(compiled(x), ref(x))
            for name, value in _state(ref).items():
                torch.testing.assert_close(_state(model)[name], value, msg=name)
