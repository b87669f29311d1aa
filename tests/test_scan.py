"""``aotgrad.scan`` against the unrolled eager loop: values and every gradient."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import aotgrad
from aotgrad.loops import unrolled

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _loss(result, weights):
    leaves = [t for t in pytree.tree_leaves(result) if t is not None and t.is_floating_point()]
    return sum((t * w).sum() for t, w in zip(leaves, weights, strict=True))


def _weights(result, seed=0):
    gen = torch.Generator().manual_seed(seed)
    leaves = [t for t in pytree.tree_leaves(result) if t is not None and t.is_floating_point()]
    return [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in leaves]


def _grads(tensors):
    grads = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def check_against_unrolled(fn, init, xs, params=(), **options):
    """Scan and the eager loop agree on the result and on every input's and param's grad."""
    leaves = [t for t in pytree.tree_leaves((init, xs)) if t.requires_grad] + list(params)
    expected = unrolled(fn, init, xs)
    weights = _weights(expected)
    _loss(expected, weights).backward()
    expected_grads = _grads(leaves)
    result = aotgrad.scan(fn, init, xs, **options)
    for got, want in zip(pytree.tree_leaves(result), pytree.tree_leaves(expected), strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)
    _loss(result, weights).backward()
    for got, want in zip(_grads(leaves), expected_grads, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)
    assert any(g is not None for g in expected_grads)
    return result


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inp = nn.Linear(3, 4)


CELL = Cell()


def rnn_step(h, x):
    h = torch.tanh(CELL.lin(h) + CELL.inp(x))
    return h, h.sum(-1)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("partition", ["save_all", "mincut"])
@pytest.mark.parametrize("length", [1, 5])
def test_rnn_closed_over_linear(checkpoint, partition, length):
    h0 = torch.randn(2, 4, requires_grad=True)
    xs = torch.randn(length, 2, 3, requires_grad=True)
    check_against_unrolled(
        rnn_step, h0, xs, list(CELL.parameters()), checkpoint=checkpoint, partition=partition
    )


def test_rnn_params_only_require_grad():
    """The carry becomes differentiable after iteration 0 through the parameters."""
    h0, xs = torch.randn(2, 4), torch.randn(3, 2, 3)
    check_against_unrolled(rnn_step, h0, xs, list(CELL.parameters()))


def test_the_seed_notebook_body():
    """examples/carry.py: dict carry, dict x, the notebook's arguments."""
    spec = importlib.util.spec_from_file_location("carry_example", ROOT / "examples/carry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (carry, x), _ = module.example_inputs()
    xs = {
        k: torch.stack([v.detach() * (i + 1) for i in range(4)]).requires_grad_()
        for k, v in x.items()
    }
    check_against_unrolled(module.fn, carry, xs)
    run = aotgrad.scan_function(module.fn)
    run(carry, xs)
    names = [str(d) for d in run.traced.signature.forward_inputs]
    assert names == ["carry['a']", "carry['b']", "x['weights']", "x['biases']"]
    signature = run.traced.signature  # as docs/scan.md shows it
    assert [str(d) for d in signature.forward_outputs[signature.results_in_forward]] == [
        "output[0]['a']",
        "output[0]['b']",
        "output[1]",
    ]
    assert [d.name for d in signature.saved] == [
        "carry_a",
        "carry_b",
        "x_weights",
        "add",
        "add_1",
        "sigmoid",
    ]
    assert [str(d) for d in signature.backward_outputs] == [f"grad of {n}" for n in names]


def nested_step(carry, x):
    (a, b), c = carry
    a = a * x["u"][0] + b
    b = torch.sin(b + c["k"])
    return ((a, b), {"k": c["k"] * 0.5}), {"y": (a.sum(), b * 2)}


@pytest.mark.parametrize("checkpoint", [False, True])
def test_nested_pytrees(checkpoint):
    init = (
        (torch.randn(3, requires_grad=True), torch.randn(3)),
        {"k": torch.randn(3, requires_grad=True)},
    )
    xs = {"u": (torch.randn(4, 3, requires_grad=True),)}
    check_against_unrolled(nested_step, init, xs, checkpoint=checkpoint)


def test_length_zero_returns_init_and_empty_ys():
    init = torch.randn(2, 4)
    carry, ys = aotgrad.scan(rnn_step, init, torch.randn(0, 2, 3))
    assert carry is init
    assert ys.shape == (0, 2) and ys.dtype == torch.float32


def test_unchanged_carry_is_returned_fresh():
    """``return carry, y`` with the carry unchanged (Note [Outputs that alias])."""
    w = torch.randn(3, requires_grad=True)

    def step(carry, x):
        return carry, carry["h"] * x * w

    init = {"h": torch.randn(3, requires_grad=True)}
    carry, _ = check_against_unrolled(step, init, torch.randn(4, 3, requires_grad=True), [w])
    assert carry["h"] is not init["h"]


def test_view_of_carry_as_y():
    def step(h, x):
        h = h + x
        return h, h[0]

    check_against_unrolled(step, torch.randn(3, 2, requires_grad=True), torch.randn(4, 3, 2))


def test_a_length_does_not_capture_again():
    def step(h, x):  # its own function: scan_function(fn) is shared per fn and options
        return rnn_step(h, x)

    run = aotgrad.scan_function(step)
    for n in (3, 7, 1, 0):
        run(torch.randn(2, 4), torch.randn(n, 2, 3))
    assert run.captures == 1
    run(torch.randn(2, 4), torch.randn(3, 2, 5)[..., :3].contiguous())
    assert run.captures == 1
    run(torch.randn(5, 4), torch.randn(3, 5, 3))
    assert run.captures == 2


def test_scan_reuses_its_capture_per_function():
    def step(h, x):
        return h + x, None

    aotgrad.scan(step, torch.zeros(2), torch.ones(3, 2))
    aotgrad.scan(step, torch.zeros(2), torch.ones(6, 2))
    assert aotgrad.scan_function(step).captures == 1
    assert [str(d) for d in aotgrad.scan_function(step).traced.signature.forward_inputs] == [
        "carry",
        "x",
    ]


def test_no_grad_runs_the_forward_only():
    with torch.no_grad():
        h, ys = aotgrad.scan(rnn_step, torch.randn(2, 4), torch.randn(3, 2, 3))
    assert not h.requires_grad and ys.shape == (3, 2)


def test_descriptors_name_carry_x_and_closed_over():
    run = aotgrad.scan_function(rnn_step)
    run(torch.randn(2, 4), torch.randn(3, 2, 3))
    names = [str(d) for d in run.traced.signature.forward_inputs]
    assert names[-2:] == ["carry", "x"]
    assert "closure" in names[0] or "global" in names[0]
    assert any("lin.weight" in n for n in names)
    assert run.traced.backward is not None
    assert "tanh" in str(run.traced.seq_table())
    assert "total" in run.traced.memory_report().lower()


class DropCell(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, x):
        h = F.dropout(torch.tanh(self.lin(h) + x), p=0.5, training=True)
        return h, h


@pytest.mark.parametrize("checkpoint", [False, True])
def test_dropout_draws_as_the_unrolled_loop(checkpoint):
    """Note [Random ops in a scan]: same masks, fresh every iteration; recompute reuses them."""
    cell = DropCell()
    h0, xs = torch.randn(2, 8, requires_grad=True), torch.randn(4, 2, 8)
    torch.manual_seed(3)
    expected = unrolled(cell, h0, xs)
    weights = _weights(expected)
    _loss(expected, weights).backward()
    expected_grads = _grads([h0, *cell.parameters()])
    torch.manual_seed(3)
    result = aotgrad.scan(cell, h0, xs, checkpoint=checkpoint)
    after_forward = torch.get_rng_state()
    torch.testing.assert_close(result[1], expected[1])
    masks = result[1] == 0
    assert not torch.equal(masks[0], masks[1])  # a fresh draw per iteration
    _loss(result, weights).backward()
    assert torch.equal(torch.get_rng_state(), after_forward)  # the backward draws nothing
    for got, want in zip(_grads([h0, *cell.parameters()]), expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_checkpoint_inside_the_body():
    lin = nn.Linear(4, 4)

    def step(h, x):
        h = torch.utils.checkpoint.checkpoint(
            lambda a: torch.tanh(lin(a)) + x, h, use_reentrant=False
        )
        return h, None

    check_against_unrolled(
        step, torch.randn(2, 4, requires_grad=True), torch.randn(3, 2, 4), list(lin.parameters())
    )


def test_checkpoint_saves_only_the_carries():
    def step(h, x):
        return torch.tanh(torch.sin(h) * x).cos(), None

    saved_sizes = {}
    for checkpoint in (False, True):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t

        h0 = torch.randn(100, requires_grad=True)
        aotgrad.scan(step, h0, torch.randn(6, 100), checkpoint=checkpoint)  # capture first
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            aotgrad.scan(step, h0, torch.randn(6, 100), checkpoint=checkpoint)
        saved_sizes[checkpoint] = sum(sizes)
    assert saved_sizes[True] == 6 * 100 + 6 * 100  # the xs and one carry per iteration
    assert saved_sizes[False] > saved_sizes[True]


def test_budget_applies_to_the_body():
    check_against_unrolled(
        rnn_step,
        torch.randn(2, 4, requires_grad=True),
        torch.randn(3, 2, 3),
        list(CELL.parameters()),
        partition=aotgrad.budget(0.5),
    )


def test_compilers_receive_the_body_graphs():
    seen = []

    def compiler(gm, examples):
        seen.append(len(examples))
        return gm

    run = aotgrad.scan_function(rnn_step, fw_compiler=compiler, bw_compiler=compiler)
    run(torch.randn(2, 4, requires_grad=True), torch.randn(3, 2, 3))
    assert len(seen) == 2


def test_through_torch_compile():
    def step(h, x):
        return rnn_step(h, x)

    def model(h0, xs):
        h, ys = aotgrad.scan(step, h0, xs)
        return (h.sum() + ys.sum()) * 2

    compiled = torch.compile(model, backend="aotgrad")
    h0 = torch.randn(2, 4, requires_grad=True)
    for n in (3, 5):
        xs = torch.randn(n, 2, 3)
        expected = model(h0, xs)
        expected.backward()
        want = _grads([h0, *CELL.parameters()])
        got = compiled(h0, xs)
        got.backward()
        torch.testing.assert_close(got, expected)
        for g, w in zip(_grads([h0, *CELL.parameters()]), want, strict=True):
            torch.testing.assert_close(g, w)
    from aotgrad.loops.loop import _FUNCTIONS

    assert sum(f.captures for f in _FUNCTIONS[step].values()) == 1


def test_inside_an_aotgrad_capture_the_loop_unrolls():
    f = aotgrad.aot_function(lambda h0, xs: aotgrad.scan(rnn_step, h0, xs)[1].sum())
    h0, xs = torch.randn(2, 4, requires_grad=True), torch.randn(3, 2, 3)
    torch.testing.assert_close(f(h0, xs), unrolled(rnn_step, h0, xs)[1].sum())


# errors


def test_carry_changing_shape_is_refused():
    with pytest.raises(aotgrad.ScanError, match="changed carry leaf 0") as info:
        aotgrad.scan(lambda h, x: (torch.cat([h, x]), None), torch.zeros(2), torch.ones(3, 2))
    assert "test_scan.py" in str(info.value)


def test_carry_changing_dtype_is_refused():
    with pytest.raises(aotgrad.ScanError, match="float64"):
        aotgrad.scan(lambda h, x: (h.double() + x, None), torch.zeros(2), torch.ones(3, 2))


def test_carry_changing_structure_is_refused():
    with pytest.raises(aotgrad.ScanError, match="structure"):
        aotgrad.scan(lambda c, x: ((c["a"],), None), {"a": torch.zeros(2)}, torch.ones(3, 2))


def test_xs_of_different_lengths_are_refused():
    with pytest.raises(aotgrad.ScanError, match=r"different leading sizes \[3, 4\]"):
        aotgrad.scan(lambda h, x: (h, None), torch.zeros(2), (torch.ones(3, 2), torch.ones(4, 2)))


def test_non_tensor_xs_are_refused():
    with pytest.raises(aotgrad.ScanError, match="every leaf of xs must be a tensor"):
        aotgrad.scan(lambda h, x: (h, None), torch.zeros(2), (torch.ones(3, 2), 1.0))


def test_mutating_body_is_refused():
    def step(h, x):
        h.add_(x)
        return h * 1, None

    with pytest.raises(aotgrad.ScanError, match="mutates carry in place"):
        aotgrad.scan(step, torch.zeros(2), torch.ones(3, 2))


def test_non_pair_result_is_refused():
    with pytest.raises(aotgrad.ScanError, match=r"must return \(carry, y\)"):
        aotgrad.scan(lambda h, x: h + x, torch.zeros(2), torch.ones(3, 2))


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(1, 5),
    width=st.integers(1, 4),
    checkpoint=st.booleans(),
)
def test_fuzz_lengths_and_shapes(length, width, checkpoint):
    w = torch.randn(width, width, requires_grad=True)

    def step(c, x):
        h = torch.tanh(c["h"] @ w + x[0]) * x[1]
        return {"h": h}, (h.exp().sum(), None)

    init = {"h": torch.randn(2, width, requires_grad=True)}
    xs = (torch.randn(length, 2, width, requires_grad=True), torch.randn(length, 1, width))
    check_against_unrolled(step, init, xs, [w], checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_over_rows_gives_each_row_its_own_grads(checkpoint):
    """Rows are inputs of their own: the same result and grads as the stacked rows."""
    rows = [{"w": torch.randn(3, 3, requires_grad=True), "b": torch.randn(3)} for _ in range(4)]
    rows[2]["w"].requires_grad_(False)  # a frozen row gets no grad

    def step(h, p):
        h = torch.tanh(h @ p["w"] + p["b"])
        return h, h.sum()

    h0 = torch.randn(2, 3, requires_grad=True)
    run = aotgrad.scan_function(step, checkpoint=checkpoint)
    h, ys = run.over_rows(h0, rows)
    want_h, want_ys = unrolled(step, h0, {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(ys, want_ys)
    tensors = [h0, *(r["w"] for r in rows)]
    (want_h.sum() + want_ys.sum()).backward()
    want = _grads(tensors)
    (h.sum() + ys.sum()).backward()
    got = _grads(tensors)
    assert got[3] is None and want[3] is None
    for g, w in zip(got, want, strict=True):
        if w is not None:
            torch.testing.assert_close(g, w)
    assert run.captures == 1


def test_integer_carry_and_xs():
    """An int counter in the carry and int indices in xs: no grads for them, right values."""
    table = torch.randn(5, 3, requires_grad=True)

    def step(carry, i):
        h, n = carry
        h = torch.tanh(h + table.index_select(0, i.reshape(1))[0])
        return (h, n + 1), h[0]

    init = (torch.zeros(3, requires_grad=True), torch.tensor(0))
    (_, n), _ = check_against_unrolled(step, init, torch.tensor([4, 0, 2]), [table])
    assert n.item() == 3 and not n.requires_grad


def test_double_backward_is_refused():
    h0 = torch.randn(2, 4, requires_grad=True)
    h, _ = aotgrad.scan(rnn_step, h0, torch.randn(3, 2, 3))
    with pytest.raises(aotgrad.DoubleBackwardError, match=r"aotgrad\.scan"):
        torch.autograd.grad(h.sum(), h0, create_graph=True)


HEAD = nn.Linear(4, 2)


def step_with_head(h, x):
    h = torch.tanh(CELL.lin(h) + CELL.inp(x))
    return h, HEAD(h)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("use", ["carry", "ys"])
def test_grads_no_used_output_reaches_are_none_as_in_eager(checkpoint, use):
    """A loss of the carry alone leaves the head's grads None (not zeros), as the eager loop."""
    h0 = torch.randn(2, 4, requires_grad=True)
    xs = torch.randn(3, 2, 3, requires_grad=True)
    params = [h0, xs, *CELL.parameters(), *HEAD.parameters()]

    def loss(result):
        carry, ys = result
        return carry.sum() if use == "carry" else ys.pow(2).sum()

    loss(unrolled(step_with_head, h0, xs)).backward()
    expected = _grads(params)
    loss(aotgrad.scan(step_with_head, h0, xs, checkpoint=checkpoint)).backward()
    got = _grads(params)
    assert [g is None for g in got] == [g is None for g in expected]
    assert any(g is None for g in expected) == (use == "carry")
    for g, want in zip(got, expected, strict=True):
        if want is not None:
            torch.testing.assert_close(g, want)
