"""An input restrided in place (``t_``, ``unsqueeze_``, ``as_strided_``, ``resize_``...) and
written, in either order, with and without ``keep_inference_input_mutations``, on inputs that do
and do not require grad, with outputs viewing it: the caller's tensor, the outputs, their aliasing
and the gradients as eager leaves them (Note [Mutations kept in the graph])."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import aotgrad
from aotgrad.errors import UnsupportedMutationError

# (input shape, the in-place change of size/strides)
RESTRIDES: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], object]]] = {
    "t_": ((2, 3), lambda a: a.t_()),
    "transpose_": ((2, 3, 2), lambda a: a.transpose_(0, 2)),
    "unsqueeze_": ((2, 3), lambda a: a.unsqueeze_(1)),
    "squeeze_": ((2, 1, 3), lambda a: a.squeeze_(1)),
    "as_strided_": ((2, 3), lambda a: a.as_strided_((3, 2), (1, 3))),
    "resize_": ((2, 3), lambda a: a.resize_(3, 2)),
    "resize_smaller": ((3, 3), lambda a: a.resize_(2, 2)),
}
# resize_ of a tensor that requires grad raises in eager.
NOT_WITH_GRAD = {"resize_", "resize_smaller"}
# A written input whose new layout covers fewer elements is refused: written back through the
# new layout, an earlier write to the elements left out would be lost.
REFUSED = {"resize_smaller"}

WRITES: dict[str, Callable[[torch.Tensor], object]] = {
    "row": lambda a: a[0].mul_(2),
    "whole": lambda a: a.add_(1),
}

OUTPUTS: dict[str, Callable[[torch.Tensor], object]] = {
    "view": lambda a: a.view(a.shape),
    "row": lambda a: a[0],
    "itself": lambda a: a,
    "fresh": lambda a: (a * 3, a.sum()),
}

ORDERS = ("restride_then_write", "write_then_restride", "restride_write_restride")


def program(restride: str, write: str, output: str, order: str) -> Callable[[torch.Tensor], object]:
    change, written, out = RESTRIDES[restride][1], WRITES[write], OUTPUTS[output]

    def f(a: torch.Tensor) -> object:
        if order == "write_then_restride":
            written(a)
            change(a)
        else:
            change(a)
            written(a)
            if order == "restride_write_restride":
                a.unsqueeze_(0)
        return out(a)

    return f


def caller_input(restride: str, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The caller's tensor, and the leaf its gradient reaches (a non-leaf may be written)."""
    shape = RESTRIDES[restride][0]
    values = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 1
    if not requires_grad:
        return values, None
    root = values.requires_grad_()
    return root * 1, root


def layout(t: torch.Tensor) -> tuple[object, ...]:
    return (t.shape, t.stride(), t.storage_offset(), t.requires_grad)


def run(fn: Callable[..., object], restride: str, requires_grad: bool) -> dict[str, object]:
    a, root = caller_input(restride, requires_grad)
    result = fn(a)
    outputs = [o for o in torch.utils._pytree.tree_leaves(result) if isinstance(o, torch.Tensor)]
    seen = {
        "input": (layout(a), a.detach().clone()),
        "outputs": [(layout(o), o.detach().clone()) for o in outputs],
        "aliasing": [
            (o is a, o.untyped_storage().data_ptr() == a.untyped_storage().data_ptr())
            for o in outputs
        ],
    }
    if root is not None:
        weights = [torch.arange(float(o.numel())).reshape(o.shape) + 1 for o in outputs]
        loss = sum(((o * w).sum() for o, w in zip(outputs, weights, strict=True)), a.sum())
        loss.backward()
        seen["grad"] = root.grad
    return seen


def assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}"
        )


CASES = [
    (restride, write, output, order, requires_grad)
    for restride, write, output, order, requires_grad in itertools.product(
        RESTRIDES, WRITES, OUTPUTS, ORDERS, (False, True)
    )
    if not (requires_grad and restride in NOT_WITH_GRAD)
]


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "epilogue"])
@pytest.mark.parametrize(("restride", "write", "output", "order", "requires_grad"), CASES)
def test_restride_and_write_leave_what_eager_leaves(
    restride, write, output, order, requires_grad, keep
):
    fn = program(restride, write, output, order)
    want = run(fn, restride, requires_grad)
    compiled = aotgrad.aot_function(fn, keep_inference_input_mutations=keep)
    if restride in REFUSED:
        with pytest.raises(UnsupportedMutationError, match="no longer covers every element"):
            run(compiled, restride, requires_grad)
        return
    assert_same(run(compiled, restride, requires_grad), want)
    assert_same(run(compiled, restride, requires_grad), want)  # the cached graphs too


def test_the_issue_case_keeps_the_new_layout_in_the_graph_mode():
    """``t_()`` then a write, kept in the graph: the caller's tensor transposed, row 0 doubled."""

    def f(a):
        a.t_()
        a[0].mul_(2)
        return a.view(a.shape)

    for shape in ((2, 3), (3, 3)):  # the square one ran and wrote the transpose, silently
        a = torch.arange(9.0)[: shape[0] * shape[1]].reshape(shape)
        expected = a.clone()
        want = f(expected)
        got = aotgrad.aot_function(f, keep_inference_input_mutations=True)(a)
        assert layout(a) == layout(expected) and torch.equal(a, expected)
        assert torch.equal(got, want) and got.data_ptr() == a.data_ptr()


def test_data_only_writes_stay_in_the_graph_beside_a_restrided_input():
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(cache, a):
        cache[0] = 1.0
        a.t_()
        a[0].mul_(2)
        return cache.sum() + a.sum()

    compiled = aotgrad.aot_function(f, compiler, keep_inference_input_mutations=True)
    cache, a = torch.zeros(3, 2), torch.arange(6.0).reshape(2, 3)
    cache_e, a_e = cache.clone(), a.clone()
    out = compiled(cache, a)
    assert torch.equal(out, f(cache_e, a_e))
    assert torch.equal(cache, cache_e) and torch.equal(a, a_e) and layout(a) == layout(a_e)
    code = graphs[0].code
    assert "aten.copy_.default(cache" in code and "aten.copy_.default(a" not in code
