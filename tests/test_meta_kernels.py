"""Note [Straight to the meta kernel]: an op capture runs straight on its meta kernel gives the
layouts, dtypes, devices and aliasing PyTorch's own fake mode gives, and the cases the rule does
not cover take the fake mode's path."""

from __future__ import annotations

import contextlib
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import aotgrad
from aotgrad._torch_compat import FakeTensorMode
from aotgrad.capture.tracing.fast import fake
from aotgrad.capture.tracing.fast.fake import FastFakeMode
from aotgrad.capture.tracing.fast.meta_kernels import run_meta, straight_to_meta
from library_models import build

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "sweep"))
import opinfo_sweep

pytestmark = pytest.mark.fast_path  # Note [The fast path as a layer]

aten = torch.ops.aten


def _layout(t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device)


def _sharing(outs: list[Any], ins: list[torch.Tensor]) -> list[list[int]]:
    """For each output, the arguments whose memory it shares."""
    return [
        [i for i, x in enumerate(ins) if isinstance(o, torch.Tensor) and _same_storage(o, x)]
        for o in outs
    ]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


@contextlib.contextmanager
def cross_checked() -> Iterator[dict[str, list[str]]]:
    """Every op capture runs on its meta kernel also runs through PyTorch's fake mode; what
    differs is listed under "differs", what ran under "routed"."""
    found: dict[str, list[str]] = {"routed": [], "differs": []}

    def checked(mode: Any, func: Any, args: Any, kwargs: Any) -> object | None:
        out = run_meta(mode, func, args, kwargs)
        if out is None:
            return None
        found["routed"].append(str(func))
        expected = FakeTensorMode.dispatch(mode, func, (), args, kwargs)
        got, want = pytree.tree_leaves(out), pytree.tree_leaves(expected)
        ins = [a for a in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(a, torch.Tensor)]
        if [_layout(o) for o in got] != [_layout(o) for o in want] or _sharing(
            got, ins
        ) != _sharing(want, ins):
            found["differs"].append(f"{func}: {[_layout(o) for o in got]} != {want}")
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fake, "run_meta", checked)
        yield found


@pytest.mark.parametrize("name", ["resnet18", "convnext", "gpt2", "llama", "mobilenet_v3"])
def test_library_models_ops_match_the_fake_mode(name):
    case = build(name)
    with cross_checked() as found:
        case.loss(aotgrad.aot_module(case.model)(*case.args, **case.kwargs)).backward()
    assert not found["differs"], "\n".join(found["differs"])
    assert len(found["routed"]) > 20  # the rule covers what these models run


def test_opinfo_slice_ops_match_the_fake_mode():
    with cross_checked() as found:
        outcomes = opinfo_sweep.sweep(every=7, samples=2, runners=["aotgrad"])
    assert not found["differs"], "\n".join(found["differs"][:20])
    assert len(set(found["routed"])) > 40
    assert not [o for o in outcomes if o.status == "mismatch"]


def test_which_ops_go_straight_to_the_meta_kernel():
    assert straight_to_meta(aten.mm.default)
    assert straight_to_meta(aten.gelu.default)
    assert not straight_to_meta(aten.addmm.default)  # the fake mode runs its decomposition
    assert not straight_to_meta(aten.native_batch_norm.default)  # which reads the device
    assert straight_to_meta(aten.permute.default)  # a view: its meta result aliases
    assert not straight_to_meta(aten.add_.Tensor)  # writes an argument
    assert not straight_to_meta(aten.add.out)
    assert not straight_to_meta(aten.as_strided_.default)
    assert not straight_to_meta(aten.nonzero.default)  # data-dependent shape
    assert not straight_to_meta(aten._local_scalar_dense.default)  # reads data
    assert not straight_to_meta(aten._to_copy.default)  # a device argument
    assert not straight_to_meta(aten.view.default)  # the fake mode's own rule
    assert not straight_to_meta(aten.convolution.default)
    assert not straight_to_meta(aten.empty_strided.default)
    assert not straight_to_meta(torch.ops.prim.device.default)


def test_a_view_shares_its_arguments_memory():
    mode = FastFakeMode()
    with mode:
        x = torch.empty(2, 3, 4)
    y = run_meta(mode, aten.permute.default, (x, [2, 0, 1]), {})
    assert isinstance(y, torch.Tensor) and type(y) is type(x)
    assert _layout(y) == ((4, 2, 3), (1, 12, 4), 0, torch.float32, torch.device("cpu"))
    assert _same_storage(x, y)


def test_other_arguments_take_the_fake_modes_path():
    mode = FastFakeMode(allow_non_fake_inputs=True)
    with mode:
        x = torch.empty(4, 4)
    # a fake tensor that knows its value (the fake mode propagates those)
    constant = mode.fake_tensor_converter.from_real_tensor(
        mode, torch.tensor([1.0, 2.0, 3.0, 4.0]), make_constant=True
    )
    assert constant.constant is not None
    real = torch.ones(4, 4)
    other = FastFakeMode()
    with other:
        foreign = torch.empty(4, 4)
    assert run_meta(mode, aten.mul.Tensor, (x, x), {}) is not None
    assert run_meta(mode, aten.mul.Tensor, (x, real), {}) is None
    assert run_meta(mode, aten.mul.Tensor, (x, constant), {}) is None
    assert run_meta(mode, aten.mul.Tensor, (x, foreign), {}) is None
    assert run_meta(mode, aten.mul.Scalar, (2.0, 3.0), {}) is None  # no tensor at all


def test_symbolic_sizes_take_the_fake_modes_path():
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FastFakeMode(shape_env=ShapeEnv())
    static = mode.from_tensor(torch.empty(4, 3), static_shapes=True)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    dynamic = mode.from_tensor(torch.empty(4, 3), symbolic_context=context)
    assert isinstance(dynamic.shape[0], torch.SymInt)
    assert run_meta(mode, aten.mul.Tensor, (static, static), {}) is not None
    assert run_meta(mode, aten.mul.Tensor, (dynamic, dynamic), {}) is None
    assert run_meta(mode, aten.mul.Scalar, (static, dynamic.shape[0]), {}) is None


def test_the_meta_kernel_raises_the_fake_modes_error():
    mode = FastFakeMode()
    with mode:
        a, b = torch.empty(2, 3), torch.empty(4, 5)
    with pytest.raises(RuntimeError) as expected:
        FakeTensorMode.dispatch(mode, aten.mm.default, (), (a, b), {})
    with pytest.raises(RuntimeError) as found:
        run_meta(mode, aten.mm.default, (a, b), {})
    assert str(found.value) == str(expected.value)
