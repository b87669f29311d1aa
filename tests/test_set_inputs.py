"""``set_()`` and storage resizes on inputs, replayed on the caller's tensors as eager leaves them
(Note [set_() on an input], Note [Storage resizes of an input] in ``capture/analyses/set_storage.py``).

Each case runs eagerly and compiled on fresh inputs and compares everything a caller can see:
outputs, every input's values, size, stride, offset and storage size after the call, which
tensors share a storage, ``requires_grad``, gradients, and what a later write to each input
does to the others (storage sharing observed through values).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.errors import InPlaceOnLeafError, UnsupportedMutationError


def _layout(t: torch.Tensor, storages: dict[int, int]) -> tuple[object, ...]:
    nbytes = t.untyped_storage().nbytes()
    readable = nbytes >= (t.storage_offset() + t.numel()) * t.element_size()
    return (
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        storages.setdefault(t.untyped_storage().data_ptr(), len(storages)) if nbytes else None,
        nbytes,
        t.requires_grad,
        t.detach().clone() if readable else None,  # a freed storage holds nothing to read
    )


def _snapshot(tensors: list[torch.Tensor]) -> list[tuple[object, ...]]:
    storages: dict[int, int] = {}
    return [_layout(t, storages) for t in tensors]


def _observe(fn, args: tuple[torch.Tensor, ...]) -> list[object]:
    """What a caller sees of one call: the call, its backward, then a write to every input."""
    out = fn(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    seen: list[object] = [_snapshot([*args, *outs])]
    differentiable = [o for o in outs if o.requires_grad]
    if differentiable:
        weights = [torch.arange(1.0, o.numel() + 1).view(o.shape) for o in differentiable]
        sum((o * w).sum() for o, w in zip(differentiable, weights, strict=True)).backward()
        seen.append([a.grad for a in args if a.is_leaf])
    with torch.no_grad():
        for a in args:
            if a.numel() and a.untyped_storage().nbytes():
                a.add_(100)
    seen.append(_snapshot([*args, *outs]))
    return seen


def _same(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    return type(x) is type(y) and x == y


def _matches_eager(fn, make, compiled=None) -> None:
    compiled = compiled or aotgrad.aot_function(fn)
    eager = _observe(fn, make())
    for _ in range(2):  # the first call captures, the second runs the cached graphs
        got = _observe(compiled, make())
        assert _same(eager, got), f"eager {eager}\ncompiled {got}"


def _freed(n: int, requires_grad: bool = False) -> torch.Tensor:
    """A tensor whose storage FSDP freed: its size kept, 0 bytes under it."""
    t = torch.zeros(n, requires_grad=requires_grad)
    t.untyped_storage().resize_(0)
    return t


def set_input(a, b):
    a.set_(b)
    return a + 1


def set_view_of_input(a, b):
    a.set_(b[1:])
    return a * 2


def write_then_set_view(a, b):
    b.mul_(2)
    a.set_(b[1:])
    return a + 1


def set_intermediate(a, b):
    a.set_(b * 2)
    return a + 1


def set_view_of_intermediate(a, b):
    a.set_((b * 2)[1:])
    return a + 1


def set_storage_offset(a, b):
    a.set_(b.untyped_storage(), 1, (2,), (1,))
    return a + 1


def set_storage_no_stride(a, b):
    a.set_(b.untyped_storage(), 0, (2, 2))
    return a + 1


def set_storage(a, b):
    a.set_(b.untyped_storage())
    return a + 1


def set_intermediate_onto_input(a, b):
    t = torch.empty(0)
    t.set_(b)  # eager: t shares b's storage
    return t, a + 1


def set_view_of_the_input(a, b):
    v = a[0:2]
    v.set_(b)  # eager: v moves, a stays
    return v + 1, a * 1


def set_and_return_both(a, b):
    a.set_(b)
    return a, b


def set_empty(a, b):
    a.set_()
    return b + 1


def set_then_mul(a, b):
    a.set_(b)
    a.mul_(2)  # eager: b doubles too
    return a + 1


def set_then_write_source(a, b):
    a.set_(b)
    b.mul_(2)
    return a + 1


def set_own_view(a, b):
    a.set_(a[1:])
    return a + b.sum()


def swap_storages(a, b):
    a.set_(b)
    b.set_(a.new_zeros(2))
    return a + b.sum()


def set_and_return_input(a, b):
    a.set_(b)
    return a, a.view(2, 2)


def view_before_set(a, b):
    v = a.view(-1)
    a.set_(b)
    return v * 1, a + 1


def shape_after_set(a, b):
    a.set_(b)
    return a.view(a.shape[0] // 2, 2) * 1


def set_under_no_grad(a, b):
    with torch.no_grad():
        a.set_(b)
    return a * 2


def set_under_no_grad_then_weight(a, b, w):
    with torch.no_grad():
        a.set_(b)
    return (a * w).sum()


def free_then_set(a, b):
    a.untyped_storage().resize_(0)
    a.set_(b)
    return a + 1


def fill_freed_then_copy(a, b):
    a.untyped_storage().resize_(16)
    a.copy_(b)
    return a + 1


def fill_use_free(a, b):
    a.untyped_storage().resize_(16)
    a.copy_(b)
    out = a * 2
    a.untyped_storage().resize_(0)
    return out


def use_then_free(a, b):
    out = a * b
    a.untyped_storage().resize_(0)
    return out


def set_then_free_source(a, b):
    a.set_(b)
    a.untyped_storage().resize_(0)  # frees b's storage
    return torch.ones(1)


def write_then_grow(a, b):
    a.copy_(b)
    a.untyped_storage().resize_(32)
    return a + 1


def unshard_under_no_grad(p, full):
    with torch.no_grad():
        p.untyped_storage().resize_(16)
        p.copy_(full)
    return (p * 2).sum()


def assign_data(a, b):
    a.data = b  # FSDP's param.data = ...: no_grad, the version kept
    return a * 2


def assign_data_of_view(a, b):
    a.data = b[1:]
    return a + 1


def use_then_assign_data(a, b, w):
    out = a * w  # saves a; eager's backward then reads a's new data (no version bump)
    a.data = b
    return out


CASES = {
    "t.data = input after a use the backward saves": (
        use_then_assign_data,
        lambda: (torch.ones(4), torch.arange(4.0), torch.ones(4, requires_grad=True)),
    ),
    "t.data = input": (assign_data, lambda: (torch.zeros(4), torch.arange(4.0))),
    "t.data = input, t a leaf that requires grad": (
        assign_data,
        lambda: (torch.zeros(4, requires_grad=True), torch.arange(4.0)),
    ),
    "t.data = view of an input": (assign_data_of_view, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_(input)": (set_input, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_(view of an input)": (set_view_of_input, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_(view of a strided input)": (
        set_view_of_input,
        lambda: (torch.zeros(3), torch.arange(8.0).view(4, 2)[:, 1]),
    ),
    "write, then set_(view of a strided input)": (
        write_then_set_view,
        lambda: (torch.zeros(3), torch.arange(8.0).view(4, 2)[:, 1]),
    ),
    "set_(intermediate)": (set_intermediate, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_(view of an intermediate)": (
        set_view_of_intermediate,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_(storage, offset, size, stride)": (
        set_storage_offset,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_(storage, offset, size)": (
        set_storage_no_stride,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_(storage)": (set_storage, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_(storage of a view input)": (
        set_storage,
        lambda: (torch.zeros(3), torch.arange(6.0)[1:3]),
    ),
    "set_(storage of a view input, offset, size, stride)": (
        set_storage_offset,
        lambda: (torch.zeros(3), torch.arange(6.0)[2:4]),
    ),
    "an intermediate set_ onto an input, returned": (
        set_intermediate_onto_input,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_ on a view of the input": (
        set_view_of_the_input,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_ and return both inputs": (
        set_and_return_both,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_()": (set_empty, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_ then mul_": (set_then_mul, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_ then a write to the source": (
        set_then_write_source,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "set_(own view)": (set_own_view, lambda: (torch.zeros(3), torch.arange(4.0))),
    "two inputs swap storages": (swap_storages, lambda: (torch.zeros(3), torch.arange(4.0))),
    "set_ and return the input": (
        set_and_return_input,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "a view taken before set_": (view_before_set, lambda: (torch.zeros(3), torch.arange(4.0))),
    "a.shape read after set_": (shape_after_set, lambda: (torch.zeros(3), torch.arange(4.0))),
    "no_grad set_ on a leaf that requires grad": (
        set_under_no_grad,
        lambda: (torch.zeros(4, requires_grad=True), torch.arange(4.0)),
    ),
    "no_grad set_ on a non-leaf that requires grad": (
        set_under_no_grad,
        lambda: (torch.zeros(4, requires_grad=True) * 1, torch.arange(4.0)),
    ),
    "no_grad set_ from a source that requires grad": (
        set_under_no_grad,
        lambda: (torch.zeros(4), torch.arange(4.0, requires_grad=True)),
    ),
    "no_grad set_, gradient of a weight": (
        set_under_no_grad_then_weight,
        lambda: (torch.zeros(4), torch.arange(4.0), torch.ones(4, requires_grad=True)),
    ),
    "resize_(0) then set_": (free_then_set, lambda: (torch.zeros(3), torch.arange(4.0))),
    "fill a freed input, then copy_": (
        fill_freed_then_copy,
        lambda: (_freed(4), torch.arange(4.0)),
    ),
    "fill, use, free again": (fill_use_free, lambda: (_freed(4), torch.arange(4.0))),
    "use, then free": (use_then_free, lambda: (torch.ones(4), torch.arange(4.0))),
    "set_, then free the source's storage": (
        set_then_free_source,
        lambda: (torch.zeros(3), torch.arange(4.0)),
    ),
    "write, then grow the storage": (write_then_grow, lambda: (torch.zeros(4), torch.arange(4.0))),
    "unshard a freed parameter under no_grad": (
        unshard_under_no_grad,
        lambda: (_freed(4, requires_grad=True), torch.arange(4.0)),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_set_and_resize_match_eager(name):
    fn, make = CASES[name]
    _matches_eager(fn, make)


def test_set_then_mul_changes_the_source_and_shares_its_storage():
    a, b = torch.zeros(3), torch.arange(4.0)
    out = aotgrad.aot_function(set_then_mul)(a, b)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(b, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert torch.equal(out, torch.tensor([1.0, 3.0, 5.0, 7.0]))
    b.add_(1)  # one storage: a sees it
    assert torch.equal(a, b)


def test_the_signature_names_what_the_graph_returns_for_set_():
    onto_input = aotgrad.trace(set_input, torch.zeros(3), torch.arange(4.0))
    assert [str(d) for d in onto_input.signature.forward_outputs] == ["output"]
    onto_new = aotgrad.trace(set_intermediate, torch.zeros(3), torch.arange(4.0))
    assert [str(d) for d in onto_new.signature.forward_outputs] == [
        "output",
        "value set into a (set_)",
    ]


def test_trace_then_call_again_with_other_tensors():
    traced = aotgrad.trace(set_then_mul, torch.zeros(3), torch.arange(4.0))
    a, b = torch.ones(3), torch.arange(4.0) + 10
    out = traced(a, b)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(b, (torch.arange(4.0) + 10) * 2) and torch.equal(out, b + 1)


class _Sharded(nn.Module):
    """A parameter whose storage is swapped for a gathered one under no_grad, FSDP-style."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))

    def forward(self, x, gathered):
        with torch.no_grad():
            self.weight.set_(gathered)
        return (x * self.weight).sum()


class _Gathered(nn.Module):
    """FSDP1's pattern: the parameter's .data swapped for the gathered tensor."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))

    def forward(self, x, gathered):
        self.weight.data = gathered
        return (x * self.weight).sum()


@pytest.mark.parametrize("module", [_Sharded, _Gathered])
def test_aot_module_parameter_swapped(module):
    def run(model, call):
        x, gathered = torch.arange(4.0, requires_grad=True), torch.arange(4.0) + 1
        out = call(x, gathered)
        out.backward()
        shared = model.weight.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
        weight = model.weight
        return out, x.grad, weight.grad, weight.detach().clone(), weight._version, shared

    eager_model, compiled_model = module(), module()
    eager = run(eager_model, eager_model)
    compiled = run(compiled_model, aotgrad.aot_module(compiled_model))
    assert _same(list(eager), list(compiled))
    assert compiled[-1] is True


def test_data_assignment_keeps_the_version_set_bumps_it():
    for fn in (assign_data, set_input):
        versions = []
        for call in (fn, aotgrad.aot_function(fn)):
            a = torch.zeros(4)
            call(a, torch.arange(4.0))
            versions.append(a._version)
        assert versions[0] == versions[1], fn.__name__


def test_torch_compile_backend():
    # Dynamo puts x.data = y into its graph as set_() (it breaks the graph at a plain set_()
    # on a graph input, which then runs eagerly)
    eager = _observe(assign_data, (torch.zeros(4), torch.arange(4.0)))
    compiled = torch.compile(assign_data, backend="aotgrad", fullgraph=True)
    assert _same(eager, _observe(compiled, (torch.zeros(4), torch.arange(4.0))))


def mul_then_set(a, b):
    a.mul_(2)
    a.set_(b)
    return a + 1


def return_the_set_intermediate(a, b):
    t = b * 2
    a.set_(t)
    return t


def set_with_grad(a, b):
    a.set_(b)
    return a * 2


def set_new_size_under_no_grad(a, b):
    with torch.no_grad():
        a.set_(b)
    return a * 2


def set_storage_of_intermediate(a, b):
    a.set_((b * 2).untyped_storage(), 0, (2,), (1,))
    return a + 1


REFUSED = {
    "a write, then set_": (
        mul_then_set,
        lambda: (torch.ones(3), torch.arange(4.0)),
        "changes an input's values and then gives it a new storage",
    ),
    "an output over the storage set into an input": (
        return_the_set_intermediate,
        lambda: (torch.zeros(3), torch.arange(4.0)),
        "also returns that tensor or a view of it",
    ),
    "set_ with grad mode on, on a non-leaf": (
        set_with_grad,
        lambda: (torch.zeros(4, requires_grad=True) * 1, torch.arange(4.0)),
        "derivative for set_ is not implemented",
    ),
    "a new size for an input that requires grad": (
        set_new_size_under_no_grad,
        lambda: (torch.zeros(3, requires_grad=True), torch.arange(4.0)),
        "changes the size of an input that requires grad",
    ),
    "an intermediate's storage": (
        set_storage_of_intermediate,
        lambda: (torch.zeros(3), torch.arange(4.0)),
        "not the storage of an input",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_loudly_at_the_users_line(name):
    fn, make, message = REFUSED[name]
    with pytest.raises(UnsupportedMutationError, match=message) as caught:
        aotgrad.aot_function(fn)(*make())
    assert "test_set_inputs.py" in str(caught.value)


def test_set_on_a_leaf_with_grad_mode_raises_eagers_error():
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad") as eager:
        set_with_grad(torch.zeros(4, requires_grad=True), torch.arange(4.0))
    with pytest.raises(InPlaceOnLeafError, match=str(eager.value).rstrip(".")):
        aotgrad.aot_function(set_with_grad)(torch.zeros(4, requires_grad=True), torch.arange(4.0))


def use_then_set(a, b, w):
    out = a * w
    with torch.no_grad():
        a.set_(b)  # bumps a's version: the backward that saved a raises
    return out


def test_set_after_a_use_the_backward_saves_raises_eagers_error():
    make = lambda: (torch.ones(4), torch.arange(4.0), torch.ones(4, requires_grad=True))  # noqa: E731
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        use_then_set(*make()).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        aotgrad.aot_function(use_then_set)(*make()).sum().backward()


def test_set_under_dynamic_shapes_is_refused():
    with pytest.raises(UnsupportedMutationError, match="dynamic=False"):
        aotgrad.aot_function(set_input, dynamic=True)(torch.zeros(3), torch.arange(4.0))


def set_away_and_back(a):
    b = torch.arange(9, dtype=a.dtype)
    old = torch.ops.aten.alias.default(a)
    with torch.no_grad():
        a.set_(b)  # another size for a moment
        a.set_(old)
    return a * b.reshape(3, 3)


@pytest.mark.parametrize("leaf", [True, False])
def test_set_away_and_back_on_an_input_that_requires_grad_is_eagers(leaf):
    """Refused before: a set_() giving an input requiring grad another size is refused only
    if the input ends the function in it (Note [set_() on an input])."""

    def make():
        torch.manual_seed(0)
        w = torch.randn(3, 3, requires_grad=True)
        return w, (w if leaf else w * 1)

    (w_e, a_e), (w_c, a_c) = make(), make()
    out_e, out_c = set_away_and_back(a_e), aotgrad.aot_function(set_away_and_back)(a_c)
    torch.testing.assert_close(out_c, out_e)
    out_e.sum().backward()
    out_c.sum().backward()
    torch.testing.assert_close(w_c.grad, w_e.grad)
    assert a_c.shape == a_e.shape and torch.equal(a_c, a_e)
