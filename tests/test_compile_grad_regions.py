"""Grad-mode regions under torch.compile(backend="aotgrad"), against eager.

Each function computes outputs before, inside and after a region (``no_grad``,
``enable_grad``, ``set_grad_enabled``, ``inference_mode``, ``autocast``,
bare ``torch.set_grad_enabled`` calls) around an op of each kind (random, a
custom Function, in-place, views). Some of these ops stop the direct trace
inside the region, so the full trace runs Dynamo's graph a second time (Notes
[Grad-mode regions in Dynamo's graph], [Each trace starts in the caller's grad
mode]). Compared with eager: each output's value, dtype and requires_grad,
every input's gradient, the grad mode after the call; random ops under the
same seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import aotgrad
from aotgrad.errors import DirectTraceError


class Triple(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 + x * 0


def _random(a: torch.Tensor) -> torch.Tensor:
    return F.dropout(a, 0.5) + torch.rand_like(a)


def _random_strided(a: torch.Tensor) -> torch.Tensor:
    return F.dropout(a.t(), 0.3) * 2


def _function(a: torch.Tensor) -> torch.Tensor:
    return Triple.apply(a) + 1


def _inplace(a: torch.Tensor) -> torch.Tensor:
    c = a * 1
    c.t_()  # restrides: the direct trace stops
    return c.mul_(2)


def _inplace_view(a: torch.Tensor) -> torch.Tensor:
    c = a * 1
    c[0].mul_(2)
    return c


def _view(a: torch.Tensor) -> torch.Tensor:
    return a.t().unsqueeze(0).squeeze(0) * 2


OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "random": _random,
    "random_strided": _random_strided,
    "function": _function,
    "inplace": _inplace,
    "inplace_view": _inplace_view,
    "view": _view,
}


@contextlib.contextmanager
def _bare_set_grad_enabled_false() -> Iterator[None]:
    torch.set_grad_enabled(False)
    yield
    torch.set_grad_enabled(True)


# Region kind -> (the region, the caller's grad mode).
REGIONS: dict[str, tuple[Callable[[], Any], bool]] = {
    "no_grad": (torch.no_grad, True),
    "enable_grad": (torch.enable_grad, False),  # called under no_grad
    "set_grad_enabled": (lambda: torch.set_grad_enabled(False), True),
    "bare_set_grad_enabled": (_bare_set_grad_enabled_false, True),
    "inference_mode": (torch.inference_mode, True),
    "autocast": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), True),
}


def _make(region: str, op: str, breaks: bool) -> Callable[..., Any]:
    enter, _ = REGIONS[region]
    body = OPS[op]

    def fn(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        before = Triple.apply(a) * w
        with enter():
            inside = body(a) * w
            if breaks:
                torch._dynamo.graph_break()
            also = (a @ w).sin()
        after = (a @ w) * 5 + body(a)
        return before, inside, also, after

    return fn


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(3, 3, generator=g, requires_grad=True) for _ in range(2)]


def _run(fn: Callable[..., Any], inputs: list[torch.Tensor], enabled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.set_grad_enabled(enabled):
        outs = fn(*inputs)
        mode_after = torch.is_grad_enabled()
    weights = [torch.full_like(o, 0.5 + i) for i, o in enumerate(outs)]
    diff = [(o, w) for o, w in zip(outs, weights, strict=True) if o.requires_grad]
    grads = (
        torch.autograd.grad([o for o, _ in diff], inputs, [w for _, w in diff], allow_unused=True)
        if diff
        else [None] * len(inputs)
    )
    return {
        "values": [o.detach().float() for o in outs],
        "dtypes": [o.dtype for o in outs],
        "requires_grad": [o.requires_grad for o in outs],
        "grads": grads,
        "mode_after": mode_after,
    }


def _check(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert got["requires_grad"] == expected["requires_grad"]
    assert got["dtypes"] == expected["dtypes"]
    assert got["mode_after"] == expected["mode_after"]
    for e, g in zip(expected["values"], got["values"], strict=True):
        torch.testing.assert_close(g, e, atol=1e-2, rtol=1e-2)
    for e, g in zip(expected["grads"], got["grads"], strict=True):
        assert (e is None) == (g is None)
        if e is not None:
            torch.testing.assert_close(g, e, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("region", list(REGIONS))
@pytest.mark.parametrize("how", ["default", "fullgraph", "graph_break"])
def test_region_matches_eager(region: str, op: str, how: str) -> None:
    if region == "inference_mode" and op == "random_strided" and how != "graph_break":
        pytest.xfail(
            "capture refuses (OpRuntimeError 'Cannot set version_counter for inference tensor')"
            " a random fill of a non-contiguous tensor under inference_mode, aot_function too"
        )
    _, enabled = REGIONS[region]
    fn = _make(region, op, breaks=how == "graph_break")
    expected = _run(fn, _inputs(), enabled)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotgrad", fullgraph=how == "fullgraph")
    for _ in range(2):  # the traced call, then a cached one
        _check(expected, _run(compiled, _inputs(), enabled))
    torch.set_grad_enabled(True)


def test_issue_repro_dropout_in_no_grad() -> None:
    """The fuzzer's case: an output before the region keeps requires_grad."""

    def fn2(a0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v1 = a0 * 3
        with torch.no_grad():
            v2 = F.dropout(a0, 0.5)
        return v1, v2

    b = torch.randn(1, requires_grad=True)
    torch._dynamo.reset()
    v1, v2 = torch.compile(fn2, backend="aotgrad")(b)
    assert v1.requires_grad and not v2.requires_grad
    v1.backward()
    assert b.grad is not None and b.grad.item() == 3


def test_grad_mode_left_by_the_graph_every_call() -> None:
    """``torch.set_grad_enabled(False)`` without a ``with``: eager leaves grad off for the
    caller, on every call of the compiled function, not only the traced one."""

    def fn(a: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(False)
        return a * 2

    a = torch.randn(2, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotgrad")
    try:
        for _ in range(3):
            torch.set_grad_enabled(True)
            out = compiled(a)
            assert not out.requires_grad
            assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


def test_refused_trace_restores_the_callers_modes() -> None:
    """A trace refused inside a region leaves grad mode and autocast as the caller had them."""

    def fn(a: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            v = F.dropout(a, 0.5) @ a
        return v + a

    a = torch.randn(2, 2, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aotgrad.backend(tracer="direct"))
    with pytest.raises(Exception) as info:
        compiled(a)
    assert isinstance(info.value, DirectTraceError) or isinstance(
        info.value.__cause__, DirectTraceError
    )
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    torch.set_grad_enabled(True)


@pytest.mark.parametrize("tracer", ["auto", "full"])
def test_aot_function_bare_set_grad_enabled(tracer: str) -> None:
    """Outside Dynamo: a bare ``set_grad_enabled(False)`` before an op that stops the direct
    trace, then ``set_grad_enabled(True)``; the full trace starts in the caller's mode."""

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v1 = a * 3
        torch.set_grad_enabled(False)
        v2 = F.dropout(a, 0.5)
        torch.set_grad_enabled(True)
        return v1, v2, a * 4

    inputs = _inputs()[:1]
    expected = _run(fn, inputs, True)
    compiled = aotgrad.aot_function(fn, tracer=tracer)
    for _ in range(2):
        _check(expected, _run(compiled, inputs, True))


def test_distillation_teacher_under_no_grad() -> None:
    """A student trained against a teacher run under no_grad in train mode (its dropouts draw):
    the loss, the student's parameters' .grad, and no .grad on the teacher, as eager."""
    torch.manual_seed(1)
    student = torch.nn.Linear(8, 8)
    teacher = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    teacher.train()
    x = torch.randn(2, 3, 8)

    def step(x: torch.Tensor) -> torch.Tensor:
        s = student(x)
        with torch.no_grad():
            t = teacher(x)
        return F.mse_loss(s, t)

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
        student.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = fn(x)
        loss.backward()
        grads = [p.grad for p in (*student.parameters(), *teacher.parameters())]
        return loss.detach(), grads

    expected_loss, expected_grads = run(step)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aotgrad")
    for _ in range(2):
        loss, grads = run(compiled)
        torch.testing.assert_close(loss, expected_loss)
        for e, g in zip(expected_grads, grads, strict=True):
            assert (e is None) == (g is None)
            if e is not None:
                torch.testing.assert_close(g, e)
