"""Tensor-subclass outputs against eager: a view of a subclass input is a view of the caller's
tensor, one value returned twice is one object, a view of another output has it as its base
(Note [Aliased subclass outputs]); and create_graph=True through a subclass input gives a
differentiable gradient (Note [Subclass gradients under create_graph]). Each test runs every
frontend: aot_function, aot_module, trace then call again, torch.compile(backend="aotgrad")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
from subclasses import Scaled

KINDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "TwoTensor": lambda t: TwoTensor(t, t * -2 + 1),
    "Scaled": lambda t: Scaled(t, 0.5),
}


class _Wrapped(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    calls: list[Callable[..., Any]] = []

    def call(*args: Any) -> Any:
        if not calls:
            calls.append(aotgrad.trace(fn, *args))
            return calls[0](*args)  # the first call after the trace
        return calls[0](*args)

    return call


FRONTENDS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "aot_function": aotgrad.aot_function,
    "aot_module": lambda fn: aotgrad.aot_module(_Wrapped(fn)),
    "trace": _traced,
    "torch.compile": lambda fn: torch.compile(fn, backend="aotgrad"),
}


def _input(kind: str, seed: int, leaf: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(root, x): ``x`` a subclass of shape (2, 3) requiring grad; ``root`` its leaf."""
    g = torch.Generator().manual_seed(seed)
    root = KINDS[kind](torch.randn(2, 3, generator=g)).requires_grad_(True)
    return root, root if leaf else root * 1


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    if not hasattr(t, "__tensor_flatten__"):
        return [t.detach()]
    return [x for attr in t.__tensor_flatten__()[0] for x in _plain(getattr(t, attr))]


def _close(a: torch.Tensor, e: torch.Tensor) -> None:
    assert type(a) is type(e)
    for x, y in zip(_plain(a), _plain(e), strict=True):
        torch.testing.assert_close(x, y)


def _run(fn: Callable[..., Any], call: Callable[..., Any], kind: str, leaf: bool) -> Any:
    """Call twice (the second is the cached path); return what each aliasing check needs."""
    for seed in (1, 2):
        root, x = _input(kind, seed, leaf)
        outs = call(x)
        outs = outs if isinstance(outs, tuple) else (outs,)
    facts = [
        (o._is_view(), o._base is x, o._base, [o is p for p in outs], o.requires_grad) for o in outs
    ]
    loss = sum((o * (k + 1.0)).sum() for k, o in enumerate(outs))
    loss.backward()
    return root, x, outs, facts


def _compare(fn: Callable[..., Any], frontend: str, kind: str, leaf: bool = True) -> None:
    root_e, x_e, outs_e, facts_e = _run(fn, fn, kind, leaf)
    root_a, x_a, outs_a, facts_a = _run(fn, FRONTENDS[frontend](fn), kind, leaf)
    for (v_a, bx_a, b_a, same_a, rg_a), (v_e, bx_e, b_e, same_e, rg_e) in zip(
        facts_a, facts_e, strict=True
    ):
        assert (v_a, bx_a, same_a, rg_a) == (v_e, bx_e, same_e, rg_e)
        # the base is another output in both, or in neither
        assert [b_a is o for o in outs_a] == [b_e is o for o in outs_e]
    for a, e in zip(outs_a, outs_e, strict=True):
        _close(a, e)
    _close(x_a, x_e)
    _close(root_a.grad, root_e.grad)


def _view(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1)


def _unbind(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.unbind(0)


def _twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = x * 2
    return v, v


def _view_of_output(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = x * 2
    return v, v.t()


def _input_and_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.sin(), x, x[1]


def _mutated_then_viewed(x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return x.view(-1)


CASES = {
    "view": (_view, True),
    "unbind": (_unbind, True),
    "twice": (_twice, True),
    "view of output": (_view_of_output, True),
    "input and view": (_input_and_view, True),
    "mutated then viewed": (_mutated_then_viewed, False),
}


@pytest.mark.parametrize("frontend", list(FRONTENDS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("case", list(CASES))
def test_subclass_outputs_alias_as_in_eager(case: str, kind: str, frontend: str) -> None:
    """Silent before: each aliasing output came back a fresh wrapper (no ``_base``, two
    objects for ``v, v``)."""
    fn, leaf = CASES[case]
    torch._dynamo.reset()
    _compare(fn, frontend, kind, leaf)


def _inplace_error(call: Callable[..., Any], mutate: Callable[[Any], Any]) -> str:
    _, x = _input("TwoTensor", 3, leaf=False)
    outs = call(x)
    try:
        mutate(outs)
    except RuntimeError as e:
        return "multiple views" if "multiple views" in str(e) else str(e)
    return "no error"


@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_unbind_outputs_of_a_subclass_input_refuse_in_place_changes(frontend: str) -> None:
    """Silent before: ``out[0].mul_(2)`` ran where eager refuses it (Note [Multi-output views])."""
    torch._dynamo.reset()

    def mutate(outs: Any) -> None:
        outs[0].mul_(2)

    expected = _inplace_error(_unbind, mutate)
    assert expected == "multiple views"
    assert _inplace_error(FRONTENDS[frontend](_unbind), mutate) == expected


def test_an_in_place_change_of_a_view_output_reaches_the_callers_input() -> None:
    """Silent before: the output was a fresh wrapper: ``x`` kept its values, its gradient
    skipped the ``mul_``."""
    results = []
    for call in (_view, aotgrad.aot_function(_view)):
        root, x = _input("TwoTensor", 4, leaf=False)
        out = call(x)
        out.mul_(3)
        x.sum().backward()
        results.append((x, root.grad))
    for a, e in zip(results[1], results[0], strict=True):
        _close(a, e)


def _square_sum(a: torch.Tensor) -> torch.Tensor:
    return (a * a.sin()).sum()


@pytest.mark.parametrize("frontend", list(FRONTENDS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_create_graph_through_a_subclass_input_gives_second_order_gradients(
    kind: str, frontend: str
) -> None:
    """Silent before: the gradient did not require grad, so the second order was lost."""
    torch._dynamo.reset()
    results = []
    for call in (_square_sum, FRONTENDS[frontend](_square_sum)):
        for seed in (5, 6):
            _, x = _input(kind, seed)
            (g,) = torch.autograd.grad(call(x), [x], create_graph=True)
            assert g.requires_grad
            (h,) = torch.autograd.grad((g * g).sum(), [x])
        results.append((g, h))
    for a, e in zip(results[1], results[0], strict=True):
        _close(a, e)


def test_create_graph_through_a_subclass_output() -> None:
    """The output's cotangent enters the compiled backward through ``_Wrap``'s backward."""

    def fn(a: torch.Tensor) -> torch.Tensor:
        return a.sin() * a

    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        _, x = _input("TwoTensor", 7)
        out = call(x)
        (g,) = torch.autograd.grad(out, [x], torch.ones_like(out), create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), [x])
        results.append((out, g, h))
    for a, e in zip(results[1], results[0], strict=True):
        _close(a, e)


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return (g * 2).view(2, 3)


def test_a_view_a_custom_function_returns_keeps_its_backward() -> None:
    """A view of a subclass input made by a user's Function is not rebuilt with as_strided:
    its gradient goes through the Function's backward (2 * g), as in eager."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return _Double.apply(x)

    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        root, x = _input("TwoTensor", 8)
        call(x).sum().backward()
        results.append(root.grad)
    _close(results[1], results[0])


def _dtensor(mesh: Any, seed: int) -> torch.Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    x = distribute_tensor(torch.randn(4, 3, generator=g), mesh, [Shard(0)])
    return x.requires_grad_(True)


def test_dtensor_outputs_returned_twice_and_viewed(one_rank_mesh: Any) -> None:
    """``v, v`` of a DTensor is one object (two before); a view of a DTensor input, which
    has no ``as_strided``, stays a fresh DTensor with eager's values and gradients (Note
    [Aliased subclass outputs]); create_graph=True through it is differentiable."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        v = x * 2
        return v, v, x.view(-1)

    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        x = _dtensor(one_rank_mesh, 9)
        a, b, c = call(x)
        assert a is b
        (g,) = torch.autograd.grad((a * c.view(4, 3)).sum(), [x], create_graph=True)
        assert g.requires_grad
        (h,) = torch.autograd.grad((g * g).sum(), [x])
        results.append([t.full_tensor() for t in (a, c, g, h)])
    for a, e in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(a, e)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(10)
        w = torch.randn(2, 3, generator=g)
        self.w = torch.nn.Parameter(TwoTensor(w, w * 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.w * x, self.w.t(), self.w


_GLOBAL_MODEL = _Model()


def _closure_loss(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _GLOBAL_MODEL(x)


@pytest.mark.parametrize("frontend", ["aot_module", "closure", "torch.compile"])
def test_a_subclass_parameter_returned_and_viewed(frontend: str) -> None:
    """Silent before: ``self.w`` came back a fresh wrapper (not the parameter), ``self.w.t()``
    no view of it."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model = _GLOBAL_MODEL if frontend == "closure" else _Model()
        call: Callable[..., Any] = _closure_loss if frontend == "closure" else model
        if compiled and frontend == "aot_module":
            call = aotgrad.aot_module(model)
        elif compiled and frontend == "closure":
            call = aotgrad.aot_function(_closure_loss)
        elif compiled:
            call = torch.compile(model, backend="aotgrad")
        model.w.grad = None
        for seed in (11, 12):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
            a, b, c = call(x)
        assert c is model.w
        assert b._base is model.w
        (a.sum() + (b * 2).sum() + (c * 3).sum()).backward()
        results.append((a, b, model.w.grad))
    for x, y in zip(results[1], results[0], strict=True):
        _close(x, y)


def _unbind_of_intermediate(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x * 2).unbind(0)


@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_unbind_outputs_of_a_subclass_intermediate_refuse_in_place_changes(frontend: str) -> None:
    """Silent before: ``out[0].mul_(2)`` ran where eager refuses it; values and gradients as
    eager's."""
    torch._dynamo.reset()

    def mutate(outs: Any) -> None:
        outs[1].add_(1)

    call = FRONTENDS[frontend](_unbind_of_intermediate)
    assert _inplace_error(_unbind_of_intermediate, mutate) == "multiple views"
    assert _inplace_error(call, mutate) == "multiple views"
    results = []
    for f in (_unbind_of_intermediate, call):
        root, x = _input("TwoTensor", 13)
        outs = f(x)
        assert all(o._is_view() for o in outs)
        (outs[0] * 2 + outs[1]).sum().backward()
        results.append((*outs, root.grad))
    for a, e in zip(results[1], results[0], strict=True):
        _close(a, e)


def _rows_of_intermediate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = x * 3
    return v[0], v[1]


def _split_of_intermediate(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x * 3).split(1)


@pytest.mark.parametrize(
    "fn", [_unbind_of_intermediate, _rows_of_intermediate, _split_of_intermediate]
)
@pytest.mark.parametrize("kind", list(KINDS))
def test_views_of_one_subclass_intermediate_each_get_their_gradient(
    kind: str, fn: Callable[..., Any]
) -> None:
    """Silent before: the second view was rebuilt from the first's inner tensors with
    ``as_strided``, past their extent, and its gradient was dropped (row 1 of x.grad: 0)."""
    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        root, x = _input(kind, 14)
        a, b = call(x)
        (a * 2 + b * 10).sum().backward()
        results.append((a, b, root.grad))
    for a, e in zip(results[1], results[0], strict=True):
        _close(a, e)


class _Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[0], x[1]

    @staticmethod
    def backward(ctx: Any, g0: torch.Tensor, g1: torch.Tensor) -> torch.Tensor:
        return torch.stack([g0 * 2, g1 * 3])


def test_views_a_custom_function_returns_of_an_input_each_get_their_gradient() -> None:
    """The same on plain tensors (Note [Inputs returned by a custom Function]): silent before,
    x.grad's row 1 was 0 where eager's is 30."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _Rows.apply(x)

    results = []
    for call in (fn, aotgrad.aot_function(fn)):
        root = torch.randn(2, 3, generator=torch.Generator().manual_seed(15)).requires_grad_()
        x = root * 1
        a, b = call(x)
        assert a._base is x and b._base is x
        (a + b * 10).sum().backward()
        results.append((a.detach(), b.detach(), root.grad))
    for a, e in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(a, e)
