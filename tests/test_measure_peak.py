"""``aotgrad.testing.measure_peak``: the allocator's peak during a step, counted exactly on CPU."""

from __future__ import annotations

import pytest
import torch

from aotgrad.testing import measure_peak


def test_counts_what_is_live_at_once_not_what_existed_before():
    x = torch.randn(1000)  # 4000 bytes before the step: not counted

    def step():
        y = x.sin()  # 4000
        z = y.cos()  # 8000 live: the peak
        del y
        return z.exp()  # z and exp: 8000 again

    assert measure_peak(step) == 8000


def test_only_what_the_step_allocated_counts():
    held = [torch.randn(1000)]

    def step():
        held.pop()  # an older tensor freed: the CPU count never saw it allocated
        return torch.randn(500)  # +2000

    assert measure_peak(step) == 2000


def test_a_backward_counts_its_saved_values_and_gradients():
    w = torch.randn(100, 100, requires_grad=True)  # 40000 bytes

    def step():
        (w * w).sum().backward()

    peak = measure_peak(step)
    w.grad = None
    # w * w (40000, freed once summed), then w.grad = 2 * w (40000) and the temporaries of mul's
    # backward: never more than three 40000-byte tensors at once, at least one gradient.
    assert 40000 <= peak <= 3 * 40000 + 64


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="CPU or CUDA"):
        measure_peak(lambda: None, device="meta")
