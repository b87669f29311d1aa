"""Graph names come from the user's names, whatever their case (BERT's ``LayerNorm``, T5's ``DenseReluDense``)."""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad.testing import verify


class UpperCase(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.LayerNorm = torch.nn.LayerNorm(4)
        self.DenseReluDense = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.DenseReluDense(self.LayerNorm(x)).relu()


@pytest.mark.parametrize("partition", ["save_all", "mincut", aotgrad.budget(0.5)], ids=str)
def test_uppercase_parameter_names_partition(partition: object) -> None:
    torch.manual_seed(0)
    model = UpperCase()
    traced = aotgrad.trace(model, torch.randn(3, 4, requires_grad=True), partition=partition)
    saved = {s.name: s for s in traced.saved}
    assert "LayerNorm_weight" in saved
    assert saved["LayerNorm_weight"].users, "the saved weight's backward users were not found"
    compile_fn = lambda m: aotgrad.aot_module(m, partition=partition)  # noqa: E731
    assert verify(model, torch.randn(3, 4), compile_fn=compile_fn).ok
