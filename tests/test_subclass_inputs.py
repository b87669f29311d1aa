"""Tensor subclass inputs changed in place, against eager: the caller's tensor after the call
(outer size, strides, offset, version; inner tensors' layouts and values), outputs, and every
gradient, through each frontend (Note [Subclass inputs changed in place], Note [Subclass inputs
rebased]). Subclasses: torch's ``TwoTensor``, which keeps its outer metadata in step with
in-place view ops, the tests' ``TwoTensor``, which does not, and ``Scaled``, whose flatten
context holds a scale."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor as TorchTwoTensor

import aotgrad
from aotgrad.errors import InPlaceOnLeafError, UnsupportedMutationError
from subclasses import Scaled
from subclasses import TwoTensor as TestsTwoTensor

KINDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch TwoTensor": lambda t: TorchTwoTensor(t, t * -2 + 1),
    "tests' TwoTensor": lambda t: TestsTwoTensor(t, t * -2 + 1),
    "Scaled": lambda t: Scaled(t, 0.5),
}


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (possibly nested) subclass holds, in flatten order."""
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    attrs, _ = t.__tensor_flatten__()
    return [x for attr in attrs for x in _inner(getattr(t, attr))]


def _state(t: torch.Tensor) -> list[Any]:
    """What eager leaves on a subclass tensor: its type and context, outer layout, each inner
    tensor's layout and values (versions: ``test_a_data_change_moves_the_callers_version_on``)."""
    out: list[Any] = [type(t), t.__tensor_flatten__()[1] if hasattr(t, "__tensor_flatten__") else 0]
    out += [tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad]
    for x in _inner(t):
        out += [tuple(x.shape), x.stride(), x.storage_offset(), x.detach().clone()]
    return out


def _assert_same(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e)
        else:
            assert a == e, (actual, expected)


def _inputs(kind: str, grad: bool, contiguous: bool, seed: int) -> tuple[list[torch.Tensor], Any]:
    """(leaves, (x, y)): ``x`` a subclass of shape (2, 3), a non-leaf when ``grad`` (eager
    refuses in-place ops on leaves that require grad); ``y`` a plain tensor."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 3, generator=g) if contiguous else torch.randn(3, 2, generator=g).t()
    leaf = KINDS[kind](base)
    y = torch.randn(2, 3, generator=g)
    if not grad:
        return [], (leaf, y)
    leaf.requires_grad_(True)
    return [leaf], (leaf * 1, y)


def _compare(
    fn: Callable[..., Any], run: Callable[..., Any], kind: str, grad: bool, contiguous=True
):
    """``run(*args)`` against ``fn(*args)`` on equal inputs: outputs, the caller's ``x`` after
    the call, then gradients of a loss reading the output and ``x`` as it is now."""
    results = []
    for call in (fn, run):
        leaves, (x, y) = _inputs(kind, grad, contiguous, seed=0)
        out = call(x, y)
        state = _state(x)
        loss = (out * out).sum() + (x * x).sum()
        if loss.requires_grad:
            loss.backward()
        grads = [
            [g for g in _inner(leaf.grad)] if leaf.grad is not None else None for leaf in leaves
        ]
        results.append((_inner(out), state, grads))
    (out_e, state_e, grads_e), (out, state, grads) = results
    _assert_same(out, out_e)
    _assert_same(state, state_e)
    assert [g is None for g in grads] == [g is None for g in grads_e]
    for g, e in zip(grads, grads_e, strict=True):
        if e is not None:
            _assert_same(g, e)


def _t(x, y):
    x.t_()
    return x * y.t()


def _transpose(x, y):
    x.transpose_(0, 1)
    return x * y.t()


def _unsqueeze(x, y):
    x.unsqueeze_(0)
    return x * y


def _squeeze(x, y):
    x.unsqueeze_(1).squeeze_(1)
    return x * y


def _as_strided(x, y):
    x.as_strided_((3,), (1,), x.storage_offset())
    return x * y[0]


def _mul_then_t(x, y):
    x.mul_(2)
    x.t_()
    return x * y.t()


def _t_then_add(x, y):
    x.t_()
    x.add_(y.t())
    return x * 3


def _mul(x, y):
    x.mul_(y)
    return x + 1


FUNCTIONS = {
    "t_": _t,
    "transpose_": _transpose,
    "unsqueeze_": _unsqueeze,
    "unsqueeze_ squeeze_": _squeeze,
    "as_strided_": _as_strided,
    "mul_ then t_": _mul_then_t,
    "t_ then add_": _t_then_add,
    "mul_": _mul,
}


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "requires grad"])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_subclass_input_changed_in_place_is_left_as_eager_leaves_it(name, grad):
    """Silent before: the caller's outer tensor kept its size and strides (and, requiring
    grad, its old history: a later use's gradient skipped the in-place op)."""
    fn = FUNCTIONS[name]
    _compare(fn, aotgrad.aot_function(fn), "torch TwoTensor", grad)


@pytest.mark.parametrize("name", ["t_", "mul_ then t_", "t_ then add_", "unsqueeze_"])
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "requires grad"])
def test_a_subclass_with_a_context_changed_in_place_is_left_as_eager_leaves_it(name, grad):
    """``Scaled`` keeps a scale in its flatten context, and one inner tensor."""
    fn = FUNCTIONS[name]
    _compare(fn, aotgrad.aot_function(fn), "Scaled", grad)


@pytest.mark.parametrize("name", ["t_", "mul_ then t_", "t_ then add_"])
def test_a_subclass_that_leaves_its_outer_metadata_stale_stays_stale_as_in_eager(name):
    """The tests' TwoTensor does not keep its outer size in step with ``t_()`` (its inner
    tensors are transposed, it is not): the compiled function leaves it so too."""
    fn = FUNCTIONS[name]
    _compare(fn, aotgrad.aot_function(fn), "tests' TwoTensor", False)


@pytest.mark.parametrize("name", ["mul_", "mul_ then t_"])
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "requires grad"])
def test_a_data_change_moves_the_callers_version_on(name, grad):
    """Autograd checks saved tensors' versions: a data change moves the caller's outer
    version on, as eager's in-place op does."""
    _, (x, y) = _inputs("torch TwoTensor", grad, True, seed=2)
    before = x._version
    aotgrad.aot_function(FUNCTIONS[name])(x, y)
    assert x._version > before


@pytest.mark.parametrize("name", ["t_", "mul_ then t_", "unsqueeze_"])
def test_a_non_contiguous_subclass_input_changed_in_place(name):
    fn = FUNCTIONS[name]
    for grad in (False, True):
        _compare(fn, aotgrad.aot_function(fn), "torch TwoTensor", grad, contiguous=False)


def test_trace_then_call_again_replays_on_each_callers_tensor():
    _, args = _inputs("torch TwoTensor", True, True, seed=1)
    traced = aotgrad.trace(_mul_then_t, *args)
    for _ in range(2):
        _compare(_mul_then_t, traced, "torch TwoTensor", True)


def test_torch_compile_with_the_aotgrad_backend_replays_the_change():
    torch._dynamo.reset()
    _compare(_mul_then_t, torch.compile(_mul_then_t, backend="aotgrad"), "torch TwoTensor", True)
    torch._dynamo.reset()
    _compare(_t, torch.compile(_t, backend="aotgrad"), "torch TwoTensor", False)


class _Transposing(torch.nn.Module):
    """Scales its input in place by a TwoTensor parameter, then transposes it."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        w = TorchTwoTensor(torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g))
        self.w = torch.nn.Parameter(w)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(self.w)
        x.t_()
        return x * y.t()


def test_aot_module_with_a_subclass_parameter_changing_its_input_in_place():
    import copy

    model = _Transposing()
    eager = copy.deepcopy(model)
    compiled = aotgrad.aot_module(model)
    _compare(eager, compiled, "torch TwoTensor", True)
    _assert_same(_inner(model.w.grad), _inner(eager.w.grad))


@pytest.mark.parametrize("name", ["t_", "mul_"])
def test_an_in_place_change_of_a_subclass_leaf_requiring_grad_raises_as_eager(name):
    """Silent before: the compiled function ran it (the inner tensors, leaves of the trace,
    could not tell)."""
    fn = FUNCTIONS[name]
    x = TorchTwoTensor(torch.ones(2, 3), torch.ones(2, 3)).requires_grad_(True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        fn(x, torch.ones(2, 3))
    with pytest.raises(InPlaceOnLeafError, match=r"requires grad \(x\)") as info:
        aotgrad.aot_function(fn)(x, torch.ones(2, 3))
    assert "test_subclass_inputs.py" in str(info.value)  # the user's line
    assert x.shape == (2, 3) and x._version == 0


def test_under_no_grad_a_subclass_leaf_requiring_grad_may_change_as_in_eager():
    """An optimizer-style update: no history, the leaf stays a leaf, its gradient as eager's."""

    def fn(x, y):
        with torch.no_grad():
            x.mul_(2)
        return x * y

    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        x = TorchTwoTensor(torch.ones(2, 3), torch.full((2, 3), 2.0)).requires_grad_()
        out = call(x, torch.arange(6.0).view(2, 3))
        (out * out).sum().backward()
        assert x.is_leaf
        results.append((_inner(out), _state(x), _inner(x.grad)))
    for actual, expected in zip(results[1], results[0], strict=True):
        _assert_same(actual, expected)


class _HalfWritten(TorchTwoTensor):
    """A TwoTensor whose in-place data ops change ``a`` only."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and torch.Tag.inplace_view not in func.tags:
            plain = [a.a if isinstance(a, TorchTwoTensor) else a for a in args]
            func(*plain, **(kwargs or {}))
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _HalfWritten(inner["a"], inner["b"], outer_size, outer_stride)


def test_a_change_with_grad_writing_some_inner_tensors_only_is_refused():
    x = _HalfWritten(torch.ones(2, 3), torch.ones(2, 3)).requires_grad_(True) * 1
    with pytest.raises(UnsupportedMutationError, match="some of its inner tensors"):
        aotgrad.aot_function(_mul)(x, torch.ones(2, 3))


# --- Subclass gradients of plain inputs (Note [Subclass gradients of plain inputs]) -----------


def _mix(x, t):
    return (x * t).sin()


def _mix_twice(x, t):
    return (x * t).sin() + (t * x.cos()).exp() + x * 2


def _matmul(x, t):
    return (t @ x).tanh()


def _built_from_plain(x, y):
    return TorchTwoTensor(x, x * 2) * y  # the constructor is not differentiable: x gets none


MIXES = {
    "x * t": (_mix, (2, 3)),
    "x and t used twice": (_mix_twice, (2, 3)),
    "t @ x": (_matmul, (3, 4)),
}


def _grad_state(g: torch.Tensor | None) -> list[Any] | None:
    if g is None:
        return None
    context = g.__tensor_flatten__()[1] if hasattr(g, "__tensor_flatten__") else 0
    return [type(g), context, tuple(g.shape), *_inner(g)]


def _mixed_inputs(kind: str, x_shape: tuple[int, ...], t_grad: bool) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(x_shape, generator=g).requires_grad_(True)
    t = KINDS[kind](torch.randn(2, 3, generator=g)).requires_grad_(t_grad)
    return x, t


def _check_mixed(fn, run, kind: str, x_shape, t_grad: bool) -> None:
    results = []
    for call in (fn, run):
        x, t = _mixed_inputs(kind, x_shape, t_grad)
        out = call(x, t)
        (out * out).sum().backward()
        results.append((_inner(out), _grad_state(x.grad), _grad_state(t.grad)))
    (out_e, xg_e, tg_e), (out, xg, tg) = results
    _assert_same(out, out_e)
    assert xg_e is not None and xg_e[0] is not torch.Tensor  # eager: a subclass gradient
    _assert_same(xg, xg_e)
    assert (tg is None) == (tg_e is None)
    if tg_e is not None:
        _assert_same(tg, tg_e)


@pytest.mark.parametrize("t_grad", [False, True], ids=["t no grad", "t requires grad"])
@pytest.mark.parametrize("kind", ["torch TwoTensor", "Scaled"])
@pytest.mark.parametrize("name", list(MIXES))
def test_a_plain_input_gets_the_subclass_gradient_eager_gives_it(name, kind, t_grad):
    """Refused before (``UnsupportedSubclassError``): ``x.grad`` is a TwoTensor (a Scaled with
    its scale) in eager, of the values, type and context eager gives."""
    fn, x_shape = MIXES[name]
    _check_mixed(fn, aotgrad.aot_function(fn), kind, x_shape, t_grad)


def test_the_subclass_gradient_matches_pytorchs_aot_function():
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function

    _check_mixed(_mix_twice, aot_function(_mix_twice, nop), "torch TwoTensor", (2, 3), True)
    _check_mixed(_mix_twice, aotgrad.aot_function(_mix_twice), "torch TwoTensor", (2, 3), True)


def test_a_plain_input_split_by_its_gradient_names_each_place():
    x, t = _mixed_inputs("torch TwoTensor", (2, 3), False)
    traced = aotgrad.trace(_mix, x, t)
    assert [str(d) for d in traced.signature.forward_inputs] == ["x.a", "x.b", "t.a", "t.b"]
    assert [str(d) for d in traced.signature.backward_outputs] == [
        "grad of x.a",
        "grad of x.b",
        "None",
        "None",
    ]
    for _ in range(2):  # trace, then call again on new inputs
        _check_mixed(_mix, traced, "torch TwoTensor", (2, 3), False)


def test_torch_compile_gives_a_plain_input_its_subclass_gradient():
    torch._dynamo.reset()
    _check_mixed(_mix, torch.compile(_mix, backend="aotgrad"), "torch TwoTensor", (2, 3), True)


def test_aot_module_gives_plain_parameters_their_subclass_gradients():
    import copy

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    eager = copy.deepcopy(model)
    compiled = aotgrad.aot_module(model)
    for step in range(2):
        x = TorchTwoTensor(torch.randn(5, 3), torch.randn(5, 3) + step)
        out, out_e = compiled(x), eager(x)
        _assert_same(_inner(out), _inner(out_e))
        out.pow(2).sum().backward()
        out_e.pow(2).sum().backward()
        for p, e in zip(model.parameters(), eager.parameters(), strict=True):
            _assert_same(_grad_state(p.grad), _grad_state(e.grad))
    assert compiled.compiled.info.misses == 1


def test_a_subclass_built_from_a_plain_input_gives_it_no_gradient_as_in_eager():
    results = []
    for call in (_built_from_plain, aotgrad.aot_function(_built_from_plain)):
        g = torch.Generator().manual_seed(6)
        x, y = (torch.randn(3, generator=g).requires_grad_() for _ in "xy")
        out = call(x, y)
        out.sum().backward()
        results.append((_inner(out), x.grad, _grad_state(y.grad)))
    (out_e, xg_e, yg_e), (out, xg, yg) = results
    _assert_same(out, out_e)
    assert xg is None and xg_e is None
    _assert_same(yg, yg_e)


# --- Subclass inputs over one storage (Note [Inputs sharing memory without a common base]) ----


def _two_over(rows_x, rows_y, *, detach_y=False, x_grad=False, y_grad=False):
    """Two TwoTensors over rows of the same two plain tensors; returns (x, y, the plains)."""
    b1, b2 = torch.arange(12.0).view(4, 3), -torch.arange(12.0).view(4, 3) + 0.5
    c1, c2 = (b1.detach(), b2.detach()) if detach_y else (b1, b2)
    x = TorchTwoTensor(b1[rows_x], b2[rows_x]).requires_grad_(x_grad)
    y = TorchTwoTensor(c1[rows_y], c2[rows_y]).requires_grad_(y_grad)
    return x, y, (b1, b2)


def _double_x(x, y):
    x.mul_(2)
    return x * y


def _add_to_y(x, y):
    y.add_(1)
    return (x * 3).sin() + y


def _check_shared(fn, run, **layout) -> None:
    results = []
    for call in (fn, run):
        x, y, plains = _two_over(**layout)
        out = call(x, y)
        if out.requires_grad:
            (out * out).sum().backward()
        grads = [_grad_state(t.grad) for t in (x, y)]
        results.append((_inner(out), [p.clone() for p in plains], grads))
    (out_e, plains_e, grads_e), (out, plains, grads) = results
    _assert_same(out, out_e)
    _assert_same(plains, plains_e)  # the caller's memory, as eager left it
    assert [g is None for g in grads] == [g is None for g in grads_e]
    for g, e in zip(grads, grads_e, strict=True):
        if e is not None:
            _assert_same(g, e)


OVERLAPS = {
    "rows 0-1 and 1-2": {"rows_x": slice(0, 2), "rows_y": slice(1, 3)},
    "rows 0-1 and 1-2, y over a detached alias": {
        "rows_x": slice(0, 2),
        "rows_y": slice(1, 3),
        "detach_y": True,
    },
    "the same rows": {"rows_x": slice(1, 3), "rows_y": slice(1, 3)},
}


@pytest.mark.parametrize("fn", [_double_x, _add_to_y], ids=["x.mul_", "y.add_"])
@pytest.mark.parametrize("name", list(OVERLAPS))
def test_subclass_inputs_over_overlapping_memory_see_each_others_changes(name, fn):
    """Refused before ("share memory without a common base"); PyTorch's aot_function takes the
    inputs for distinct and returns the wrong values here."""
    _check_shared(fn, aotgrad.aot_function(fn), **OVERLAPS[name])


DISJOINT = {
    "rows, x requires grad": {"rows_x": slice(0, 2), "rows_y": slice(2, 4), "x_grad": True},
    "columns, y over a detached alias, x requires grad": {
        "rows_x": (slice(None), slice(0, 1)),
        "rows_y": (slice(None), slice(1, 3)),
        "detach_y": True,
        "x_grad": True,
    },
}


@pytest.mark.parametrize("name", list(DISJOINT))
def test_subclass_inputs_over_disjoint_parts_of_one_storage_as_eager_and_pytorch(name):
    """PyTorch's false aliasing: one storage, no element in common. Refused before."""
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function

    _check_shared(_add_to_y, aotgrad.aot_function(_add_to_y), **DISJOINT[name])
    _check_shared(_add_to_y, aot_function(_add_to_y, nop), **DISJOINT[name])


def test_overlapping_subclass_inputs_through_trace_and_torch_compile():
    layout = OVERLAPS["rows 0-1 and 1-2"]
    x, y, _ = _two_over(**layout)
    traced = aotgrad.trace(_double_x, x, y)
    for _ in range(2):
        _check_shared(_double_x, traced, **layout)
    torch._dynamo.reset()
    _check_shared(_double_x, torch.compile(_double_x, backend="aotgrad"), **layout)


def test_a_call_over_overlapping_memory_after_one_over_distinct_memory_traces_again():
    """The inner tensors' sharing is part of the key: the first call's graph (distinct inputs)
    would miss the second's overlap, silently."""
    compiled = aotgrad.aot_function(_double_x)

    def distinct() -> tuple[torch.Tensor, torch.Tensor]:
        b1, b2, c1, c2 = (torch.arange(12.0).view(4, 3) for _ in range(4))
        return TorchTwoTensor(b1[0:2], b2[0:2]), TorchTwoTensor(c1[1:3], c2[1:3])

    _assert_same(_inner(compiled(*distinct())), _inner(_double_x(*distinct())))
    _check_shared(_double_x, compiled, **OVERLAPS["rows 0-1 and 1-2"])
    assert compiled.info.misses == 2


def test_overlapping_subclass_inputs_one_requiring_grad_are_refused_naming_them():
    x, y, plains = _two_over(slice(0, 2), slice(1, 3), detach_y=True, x_grad=True)
    before = [p.clone() for p in plains]
    with pytest.raises(UnsupportedMutationError, match=r"inputs x\.a, y\.a share memory") as info:
        aotgrad.aot_function(_add_to_y)(x, y)
    assert "one requires grad" in str(info.value)
    _assert_same(list(plains), before)


def test_a_shape_change_of_a_subclass_input_over_shared_memory_is_refused():
    def fn(x, y):
        y.add_(1)
        x.t_()
        return x * 2

    x, y, _ = _two_over(slice(0, 2), slice(1, 3))
    with pytest.raises(UnsupportedMutationError, match="shape, strides or autograd history"):
        aotgrad.aot_function(fn)(x, y)


def test_a_dtensor_input_changed_in_place_with_grad_passes_the_change_to_its_gradient(
    one_rank_mesh,
):
    """Silent before: a later use of the changed DTensor sent its gradient past ``mul_``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    results = []
    for call in (_mul, aotgrad.aot_function(_mul)):
        g = torch.Generator().manual_seed(7)
        leaf = distribute_tensor(torch.randn(2, 3, generator=g), one_rank_mesh, [Shard(0)])
        leaf.requires_grad_(True)
        y = distribute_tensor(torch.randn(2, 3, generator=g), one_rank_mesh, [Replicate()])
        x = leaf * 1
        out = call(x, y)
        (out.full_tensor() * x.full_tensor()).sum().backward()
        results.append((out.full_tensor(), x.full_tensor(), x.placements, leaf.grad.full_tensor()))
    for actual, expected in zip(results[1], results[0], strict=True):
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(actual, expected)
        else:
            assert actual == expected


@pytest.mark.parametrize("size", [(4, 3), (1, 2)], ids=["grown", "shrunk"])
def test_a_resized_subclass_input_is_left_as_eager_leaves_it(size):
    """Silent before: the caller's wrapper kept its size; growing it needs the wrapper's own
    storage grown (Note [Subclass inputs rebased]). (Values written after a shrink are
    refused for plain inputs too: Note [Data mutation of a restrided input].)"""

    def fn(x, y):
        x.resize_(size)
        if size == (4, 3):
            x.fill_(1.5)
        return x * 2

    _compare(fn, aotgrad.aot_function(fn), "torch TwoTensor", False)


@pytest.mark.parametrize("frontend", ["closure", "module argument"])
def test_a_closed_over_plain_parameter_gets_its_subclass_gradient(frontend):
    import copy

    torch.manual_seed(8)
    model = torch.nn.Linear(3, 2)
    eager = copy.deepcopy(model)
    if frontend == "closure":
        compiled = aotgrad.aot_function(lambda x: model(x).tanh())
        run = compiled
    else:
        compiled = aotgrad.aot_function(lambda m, x: m(x).tanh())
        run = lambda x: compiled(model, x)  # noqa: E731
    x = TorchTwoTensor(torch.randn(4, 3), torch.randn(4, 3))
    run(x).sum().backward()
    eager(x).tanh().sum().backward()
    for p, e in zip(model.parameters(), eager.parameters(), strict=True):
        _assert_same(_grad_state(p.grad), _grad_state(e.grad))


def test_a_transformer_layer_on_a_subclass_input_gives_its_plain_parameters_eagers_gradients():
    """torch's own TransformerEncoderLayer: every plain parameter's gradient is a TwoTensor in
    eager (refused before: Note [Subclass gradients of plain inputs])."""
    import copy

    torch.manual_seed(9)
    model = torch.nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
    )
    eager = copy.deepcopy(model)
    x = TorchTwoTensor(torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    out, out_e = aotgrad.aot_module(model)(x), eager(x)
    _assert_same(_inner(out), _inner(out_e))
    out.pow(2).sum().backward()
    out_e.pow(2).sum().backward()
    grads = [
        (_grad_state(p.grad), _grad_state(e.grad))
        for p, e in zip(model.parameters(), eager.parameters(), strict=True)
    ]
    assert len(grads) == 12
    for g, e in grads:
        _assert_same(g, e)


def test_a_plain_input_with_dynamic_dimensions_and_a_subclass_gradient_is_refused():
    from aotgrad.errors import UnsupportedSubclassError

    x, t = _mixed_inputs("torch TwoTensor", (2, 3), False)
    aotgrad.dynamic(x, 1)
    with pytest.raises(UnsupportedSubclassError, match=r"input x whose gradient is a .*dynamic"):
        aotgrad.aot_function(_mix)(x, t)
