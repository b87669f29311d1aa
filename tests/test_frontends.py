"""Frontends on unusual callers: nesting, threads, pickling, odd results and inputs."""

from __future__ import annotations

import threading
from collections import namedtuple

import pytest
import torch

import aotgrad
from aotgrad.compilers import nop
from aotgrad.testing import verify

Pair = namedtuple("Pair", "tensor size")


@pytest.mark.parametrize(
    "fn",
    [lambda x: (), lambda x: None, lambda x: {}, lambda x: ((), [None], 3)],
    ids=["empty-tuple", "none", "empty-dict", "nested-constants"],
)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_nop_compiles_graphs_without_outputs(fn, requires_grad):
    x = torch.randn(3, requires_grad=requires_grad)
    assert aotgrad.aot_function(fn, nop)(x) == fn(x)
    verify(fn, x, compile_fn=lambda f: aotgrad.aot_function(f, nop))


def test_nop_compiles_single_and_nested_outputs():
    def fn(x):
        return ((x.sin(),), [x.cos(), None], {"n": 1, "t": (x * 2,)})

    verify(
        fn, torch.randn(3, requires_grad=True), compile_fn=lambda f: aotgrad.aot_function(f, nop)
    )


def test_straight_line_source_of_an_empty_output_is_valid_python():
    gm = torch.fx.symbolic_trace(lambda x: ())
    source, _ = aotgrad.runtime.straight_line.straight_line_source(gm)
    compile(source, "<test>", "exec")
    assert "return ()" in source


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.shape,
        lambda x: (x.sin(), x.size()),
        lambda x: {"s": [x.sum().shape, Pair(x.cos(), x[0].shape)]},
    ],
    ids=["size", "tensor-and-size", "nested"],
)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_returned_torch_size_stays_a_torch_size(fn, requires_grad):
    x = torch.randn(2, 3, requires_grad=requires_grad)
    verify(fn, x)  # compares the output structure: Size is not tuple
    assert type(aotgrad.aot_function(fn)(x)) is type(fn(x))
    assert type(aotgrad.trace(fn, x)(x)) is type(fn(x))


def test_compiled_function_calling_a_compiled_function():
    inner = aotgrad.aot_function(lambda x, w: (x @ w).sin())

    def outer(x, w):
        return inner(x, w).cos() + inner(x * 2, w).sum()

    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    verify(outer, x, w)
    verify(aotgrad.aot_function(outer), x, w)  # compiled twice over
    assert torch.allclose(inner(x, w), (x @ w).sin())  # the inner one still works on its own


def test_aot_module_of_a_module_holding_an_aot_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(aotgrad.aot_module(torch.nn.Linear(3, 4)), torch.nn.Tanh())
    verify(model, torch.randn(2, 3))


@pytest.mark.parametrize("with_batchnorm", [False, True])
def test_verify_of_an_aot_module(with_batchnorm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    if with_batchnorm:
        model.append(torch.nn.BatchNorm1d(4))
    verify(aotgrad.aot_module(model), torch.randn(5, 3))


def test_first_calls_from_several_threads_capture_one_at_a_time():
    def fn(x):
        return (x @ x.t()).sin().sum(0) * 2

    for _ in range(3):  # a fresh function each round: every thread's call is a first call
        compiled = aotgrad.aot_function(fn)
        barrier = threading.Barrier(4)
        errors: list[BaseException] = []

        def work(compiled=compiled, barrier=barrier, errors=errors):
            x = torch.randn(4, 4, requires_grad=True)
            barrier.wait()
            try:
                out = compiled(x)
                out.sum().backward()
                assert torch.allclose(out, fn(x))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def _sparse(requires_grad=False):
    return torch.randn(4, 3).relu().to_sparse().requires_grad_(requires_grad)


@pytest.mark.parametrize(
    ("fn", "make_inputs"),
    [
        (lambda a, b: torch.sparse.mm(a, b), lambda: (_sparse(), torch.randn(3, 2))),
        # the full trace refuses a sparse input that requires grad, and fails at a @ b with
        # a CSR a: these three need the fast path (Note [The fast path as a layer])
        pytest.param(
            lambda a, b: torch.sparse.mm(a, b).sin(),
            lambda: (_sparse(True), torch.randn(3, 2, requires_grad=True)),
            marks=pytest.mark.fast_path,
        ),
        pytest.param(
            lambda a, b: (a.to_dense() * b).sum(),
            lambda: (_sparse(True), torch.randn(4, 3)),
            marks=pytest.mark.fast_path,
        ),
        (lambda a, b: a * 2, lambda: (_sparse(), torch.randn(3))),
        pytest.param(
            lambda a, b: a @ b,
            lambda: (
                torch.randn(4, 3).relu().to_sparse_csr(),
                torch.randn(3, 2, requires_grad=True),
            ),
            marks=pytest.mark.fast_path,
        ),
    ],
    ids=["mm", "mm-grads", "to-dense-grad", "sparse-output", "csr"],
)
def test_sparse_inputs_run_as_in_eager(fn, make_inputs):
    verify(fn, *make_inputs())


@pytest.mark.fast_path  # without it, the full trace refuses the sparse input first
def test_sparse_output_that_requires_grad_is_refused_clearly():
    with pytest.raises(
        aotgrad.UnsupportedOutputError, match="sparse_coo tensor that requires grad"
    ):
        aotgrad.aot_function(lambda a: a * 2)(_sparse(True))


def _double(x):
    return (x * 2).sin()


def test_pickled_aot_module_round_trips_and_compiles_again():
    import copy
    import pickle

    torch.manual_seed(0)
    model = aotgrad.aot_module(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), partition="mincut"
    )
    x = torch.randn(5, 3)
    model(x)  # compiled once before pickling
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert isinstance(copied, aotgrad.AOTModule)
        assert copied.compiled._options == model.compiled._options
        assert copied.orig_module is not model.orig_module
        verify(copied.orig_module, x)  # the copy is the same model
        eager = copy.deepcopy(copied.orig_module)
        out, expected = copied(x), eager(x)
        cotangent = torch.randn_like(out)
        out.backward(cotangent)
        expected.backward(cotangent)
        assert torch.allclose(out, expected)
        for p, q in zip(copied.orig_module.parameters(), eager.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad)
        assert copied.compiled.info.misses == 1  # captured again on first use


def test_pickled_aot_function_round_trips():
    import pickle

    compiled = aotgrad.aot_function(_double, nop)
    x = torch.randn(3, requires_grad=True)
    compiled(x)  # holds compiled graphs now
    copied = pickle.loads(pickle.dumps(compiled))
    assert torch.equal(copied(x), _double(x))
    assert copied._options == compiled._options


def test_set_of_an_input_to_a_new_storage_is_replayed_not_dropped():
    def fn(a):
        a.set_(torch.zeros(5))
        return a + 1

    a = torch.ones(3)
    out = aotgrad.aot_function(fn)(a)  # Note [set_() on an input] (tests/test_set_inputs.py)
    assert torch.equal(a, torch.zeros(5)) and torch.equal(out, torch.ones(5))
