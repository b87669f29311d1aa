"""The per-op tables of ``aotgrad.ops``: each keyed by ``OpOverload``, one rule per op, and the
one decomposition step every backend runs before it compiles (``backward_ops.decompose``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx

from aotgrad._torch_compat import OpOverload
from aotgrad.ops import backward_ops, core_aten, differentiable, upsample
from aotgrad.ops.rules import OpRules

aten = torch.ops.aten

TABLES = {
    "AS_FORWARD_OPS": backward_ops.AS_FORWARD_OPS,
    "EXTRA_DECOMPOSITIONS": core_aten.EXTRA_DECOMPOSITIONS,
    "UPSAMPLE_BACKWARD_DECOMPOSITIONS": upsample.UPSAMPLE_BACKWARD_DECOMPOSITIONS,
    "WITHOUT_DERIVATIVE": differentiable.WITHOUT_DERIVATIVE,
    "REPLACED": differentiable.REPLACED,
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_rule_table_is_keyed_by_op_overload(name: str) -> None:
    table = TABLES[name]
    assert table, f"{name} is empty"
    assert all(isinstance(op, OpOverload) for op in table), [
        op for op in table if not isinstance(op, OpOverload)
    ]
    assert all(callable(rule) for rule in table.values())


def test_the_core_aten_table_holds_the_upsampling_backwards() -> None:
    extra = core_aten.EXTRA_DECOMPOSITIONS
    for op, rule in upsample.UPSAMPLE_BACKWARD_DECOMPOSITIONS.items():
        assert extra[op] is rule
    assert extra[aten.lift_fresh.default] is extra[aten.lift_fresh_copy.default]


def test_a_second_rule_for_one_op_is_refused() -> None:
    table: OpRules[Any] = OpRules("test")
    table.register(aten.sin.default)(torch.sin)
    with pytest.raises(AssertionError, match=r"one test rule per op, got a second for aten\.sin"):
        table.add(aten.sin.default, torch.cos)
    assert table == {aten.sin.default: torch.sin}


def test_differentiable_forms() -> None:
    """``G`` runs ``copy`` through aotgrad's rule, other ops through PyTorch's decomposition."""
    assert differentiable.decomposition_of(aten.copy.default) is differentiable.functional_copy
    assert differentiable.decomposition_of(aten.silu_backward.default) is not None
    self, src = torch.zeros(2, 3).t(), torch.arange(2.0)
    got, expected = differentiable.functional_copy(self, src), aten.copy.default(self, src)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.stride() == expected.stride() == (1, 3)
    assert differentiable.REPLACED[aten.as_strided_scatter.default] is (
        differentiable.as_strided_scatter
    )


def _conv_backward(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
    return aten.convolution_backward.default(
        gy, x, w, [w.shape[0]], [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
    )


class _Backward(torch.nn.Module):
    def forward(self, gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
        return _conv_backward(gy, x, w)


class _Copies(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        return aten.copy.default(a, b), aten.copy.default(a, c)


def _targets(program: Any) -> set[Any]:
    return {n.target for n in program.graph.nodes if n.op == "call_function"}


def _conv_args() -> tuple[torch.Tensor, ...]:
    x, w = (
        torch.randn(2, 3, 8, 8, dtype=torch.float64),
        torch.randn(4, 3, 3, 3, dtype=torch.float64),
    )
    gy = torch.randn(2, 4, 4, 4, dtype=torch.float64)
    return gy, x, w


def test_decompose_writes_backward_ops_as_forward_ops() -> None:
    """By op names (IREE's call) or by table (ONNX Runtime's): no convolution_backward left,
    the gradients eager's, exactly."""
    args = _conv_args()
    program = torch.export.export(_Backward(), args)
    assert aten.convolution_backward.default in _targets(program)
    by_name = backward_ops.decompose(program, [aten.convolution_backward.default])
    by_table = backward_ops.decompose(program, backward_ops.AS_FORWARD_OPS)
    for decomposed in (by_name, by_table):
        assert aten.convolution_backward.default not in _targets(decomposed)
        assert aten.convolution.default in _targets(decomposed)
        for got, expected in zip(decomposed.module()(*args), _conv_backward(*args), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert backward_ops.decompose(program, [aten.avg_pool2d_backward.default]) is program


def _broadcast_copy(a: torch.Tensor, b: torch.Tensor, non_blocking: bool = False) -> Any:
    if a.shape == b.shape:
        return NotImplemented
    return b.expand(a.shape).clone()


def _broadcasts(node: fx.Node) -> bool:
    a, b = (arg.meta["val"].shape for arg in node.args[:2])  # type: ignore[union-attr]
    return bool(a != b)


def test_decompose_only_the_nodes_a_predicate_picks() -> None:
    """A backend's own rule beside the table, run only when one of its nodes needs it (ONNX
    Runtime's broadcasting ``copy``); a program none needs comes back as it is."""
    a, b = torch.zeros(2, 3), torch.arange(3.0)
    table = {**backward_ops.AS_FORWARD_OPS, aten.copy.default: _broadcast_copy}
    only = {aten.copy.default: _broadcasts}
    same_shape = torch.export.export(_Copies(), (a, a + 1, a + 2))
    assert backward_ops.decompose(same_shape, table, only) is same_shape
    broadcasting = torch.export.export(_Copies(), (a, b, a + 2))
    decomposed = backward_ops.decompose(broadcasting, table, only)
    assert decomposed is not broadcasting
    assert aten.expand.default in _targets(decomposed)
    assert aten.copy.default in _targets(decomposed)  # the same-shape copy is left alone
    got = decomposed.module()(a, b, a + 2)
    torch.testing.assert_close(got[0], b.expand(2, 3), rtol=0, atol=0)
    torch.testing.assert_close(got[1], a + 2, rtol=0, atol=0)
