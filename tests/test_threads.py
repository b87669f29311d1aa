"""Threads: a capture never shows another thread its fake tensors, and concurrent calls of one
compiled function all get eager's results (Note [Captures and other threads], Note
[Concurrent calls])."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.errors import AotgradError

JOIN_S = 60  # every thread is joined with this timeout


class Net(nn.Module):
    def __init__(self, norm: str = "batch") -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if norm == "batch" else nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class Handoff(nn.Module):
    """``inner``, and once, while its first capture runs: ``during`` in another thread, waited for.

    The capture is paused at a known point (after ``inner`` ran on the traced inputs), so
    what the other thread sees does not depend on the scheduler.
    """

    def __init__(self, inner: nn.Module, during: Callable[[], None]) -> None:
        super().__init__()
        self.inner = inner
        self.during = during
        self.pending = True
        self.owner = threading.get_ident()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.pending and torch.compiler.is_compiling() and threading.get_ident() == self.owner:
            self.pending = False
            _run_in_threads([self.during])
        return y


def _run_in_threads(work: list[Callable[[], None]]) -> None:
    """Run each of ``work`` in its own thread and join them all; re-raise the first error."""
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]


def _is_real(t: Any) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def _frontend(kind: str, model: nn.Module) -> Callable[..., Any]:
    if kind == "aot_module":
        return aotgrad.aot_module(model, disk_cache=False)
    if kind == "aot_function":  # the model reached through a closure
        return aotgrad.aot_function(lambda x: model(x), disk_cache=False)
    return torch.compile(model, backend="aotgrad", dynamic=False)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.pow(2).sum(), inputs)


@pytest.mark.parametrize("kind", ["aot_module", "aot_function"])
def test_an_eager_call_of_the_model_during_a_capture_gets_eagers_result(kind: str) -> None:
    # The capture pointed the model's attributes at its fake primals: the other thread's
    # eager call computed with them and got a FakeTensor back, or raised from inside torch.
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    x_other, x = torch.randn(5, 8), torch.randn(3, 8)
    seen: dict[str, Any] = {}

    def eager_call() -> None:
        seen["out"] = net(x_other)
        seen["state"] = [*net.parameters(), *net.buffers()]

    model = Handoff(net, eager_call)
    out = _frontend(kind, model)(x)
    assert _is_real(seen["out"]) and all(_is_real(t) for t in seen["state"])
    expected_other = reference(x_other)  # the same calls, in the same order
    expected = reference(x)
    torch.testing.assert_close(seen["out"], expected_other)
    torch.testing.assert_close(out, expected)
    params, reference_params = list(net.parameters()), list(reference.parameters())
    for got, want in zip(_grads(out, params), _grads(expected, reference_params), strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(net.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(got, want)  # the running stats: both calls, as in eager
    assert all(_is_real(t) for t in [*net.parameters(), *net.buffers()])


def test_another_thread_seeds_and_draws_during_a_capture() -> None:
    # The capture's torch.manual_seed stand-in refused the other thread's reseeding.
    seen: dict[str, torch.Tensor] = {}

    def draw() -> None:
        torch.manual_seed(7)
        seen["state"] = torch.get_rng_state()
        seen["draw"] = torch.rand(3)

    model = Handoff(nn.Linear(2, 2), draw)
    aotgrad.aot_module(model, disk_cache=False)(torch.randn(1, 2))
    torch.manual_seed(7)
    assert torch.equal(seen["state"], torch.get_rng_state())
    assert torch.equal(seen["draw"], torch.rand(3))


# The call in the other thread comes while the capture's global hooks are registered.
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_dynamo_compiling_in_another_thread_during_a_capture() -> None:
    # Dynamo, in another thread, traced a module call through the capture's global module
    # hooks: it broke the graph there (and raised an internal KeyError when the hooks were
    # gone before it built its guards). Now it compiles once the capture is done: one graph.
    torch._dynamo.reset()  # earlier tests' compiles of nn.Sequential must not use up its limit
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x_other = torch.randn(2, 4)
    graphs: list[torch.fx.GraphModule] = []
    compiling = threading.Event()

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        compiling.set()
        return gm

    compiled_other = torch.compile(other, backend=backend)  # compiles at its first call
    seen: dict[str, Any] = {}

    def call_other() -> None:
        try:
            seen["out"] = compiled_other(x_other)
        except BaseException as e:
            seen["error"] = e

    thread = threading.Thread(target=call_other, daemon=True)

    def start_dynamo() -> None:
        thread.start()
        compiling.wait(1)  # Dynamo now waits for the capture to end: this times out

    model = Handoff(nn.Linear(4, 4), start_dynamo)
    x = torch.randn(3, 4)
    out = aotgrad.aot_module(model, disk_cache=False)(x)
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert "error" not in seen, seen.get("error")
    torch.testing.assert_close(seen["out"], other(x_other))
    torch.testing.assert_close(out, model.inner(x))
    assert len(graphs) == 1, [g.code for g in graphs]


@pytest.mark.parametrize("kind", ["aot_module", "aot_function", "torch.compile"])
def test_concurrent_first_calls_at_different_shapes_get_eagers_results(kind: str) -> None:
    # Half of such calls raised AssertionErrors and FunctionalTensor errors from inside
    # torch: each capture's swap was visible to the others' key reading and runs.
    threads = 6 if kind == "torch.compile" else 8  # within Dynamo's recompile limit
    for seed in range(2):
        _first_calls_at_different_shapes(kind, threads, seed)


def _first_calls_at_different_shapes(kind: str, threads: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = Net(norm="layer")
    reference = copy.deepcopy(model)
    compiled = _frontend(kind, model)
    barrier = threading.Barrier(threads, timeout=JOIN_S)
    xs = [torch.randn(i + 1, 8, requires_grad=True) for i in range(threads)]
    results: list[Any] = [None] * threads

    def call(i: int) -> None:
        barrier.wait()
        out = compiled(xs[i])
        results[i] = (out, _grads(out, [xs[i], *model.parameters()]))

    _run_in_threads([lambda i=i: call(i) for i in range(threads)])
    for x, (out, grads) in zip(xs, results, strict=True):
        xe = x.detach().requires_grad_()
        expected = reference(xe)
        torch.testing.assert_close(out, expected)
        want = _grads(expected, [xe, *reference.parameters()])
        for got, w in zip(grads, want, strict=True):
            torch.testing.assert_close(got, w)


def test_concurrent_first_calls_with_one_key_trace_once() -> None:
    f = aotgrad.aot_function(lambda x: x.sin().cos(), disk_cache=False)
    barrier = threading.Barrier(8, timeout=JOIN_S)
    x = torch.randn(4, 4)
    outs: list[torch.Tensor] = []

    def call() -> None:
        barrier.wait()
        outs.append(f(x))

    _run_in_threads([call] * 8)
    assert all(torch.equal(out, x.sin().cos()) for out in outs) and len(outs) == 8
    info = aotgrad.cache_info(f)
    assert (info.misses, info.entries) == (1, 1), str(info)


def test_hits_from_many_threads_get_eagers_results() -> None:
    torch.manual_seed(0)
    model = Net(norm="layer")
    compiled = aotgrad.aot_module(model, disk_cache=False)
    xs = [torch.randn(2, 8), torch.randn(5, 8)]
    expected = [model(x) for x in xs]
    for x in xs:
        compiled(x)  # both specializations exist: every call below is a hit
    failures: list[str] = []

    def calls(i: int) -> None:
        for j in range(20):
            k = (i + j) % 2
            out = compiled(xs[k])
            if not torch.allclose(out, expected[k]):
                failures.append(f"thread {i}, call {j}")

    _run_in_threads([lambda i=i: calls(i) for i in range(8)])
    assert not failures


def test_only_aotgrads_errors_reach_a_thread() -> None:
    # A function aotgrad refuses, first called from several threads at once: each call
    # gets aotgrad's error about the user's code, never an internal one.
    def f(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x

    compiled = aotgrad.aot_function(f, disk_cache=False)
    barrier = threading.Barrier(4, timeout=JOIN_S)
    errors: list[BaseException] = []

    def call(n: int) -> None:
        barrier.wait()
        try:
            compiled(torch.ones(n + 1))
        except BaseException as e:
            errors.append(e)

    _run_in_threads([lambda n=n: call(n) for n in range(4)])
    assert len(errors) == 4 and all(isinstance(e, AotgradError) for e in errors), errors


def test_code_under_a_captures_swap_counts_as_capturing() -> None:
    """Note [Captures and other threads]: autograd's worker running a capture's backward
    (a CUDA one) inherits the capture's torch-function modes, not its Python thread-locals; a
    compiled function called there is traced through, not captured on its own (which
    waited for the capture lock the capture holds)."""
    from aotgrad.capture.tracing.session import capturing
    from aotgrad.capture.user_state.closed_over import ClosedOver

    seen: list[bool] = []

    def worker() -> None:
        seen.append(capturing())
        with ClosedOver([], [], None):  # what the engine hands its worker during a capture
            seen.append(capturing())
        seen.append(capturing())

    _run_in_threads([worker])
    assert seen == [False, True, False]


def test_first_double_backwards_from_many_threads_get_eagers_results() -> None:
    f = aotgrad.aot_function(lambda x: (x.sin() * x).sum(), disk_cache=False)
    barrier = threading.Barrier(4, timeout=JOIN_S)
    xs = [torch.randn(5, requires_grad=True) for _ in range(4)]
    outs: list[Any] = [None] * 4

    def call(i: int) -> None:
        out = f(xs[i])
        barrier.wait()  # every thread's first create_graph backward at once
        (g,) = torch.autograd.grad(out, xs[i], create_graph=True)
        outs[i] = (g, torch.autograd.grad(g.sum(), xs[i])[0])

    _run_in_threads([lambda i=i: call(i) for i in range(4)])
    for x, (g, gg) in zip(xs, outs, strict=True):
        xe = x.detach().requires_grad_()
        (ge,) = torch.autograd.grad((xe.sin() * xe).sum(), xe, create_graph=True)
        torch.testing.assert_close(g, ge)
        torch.testing.assert_close(gg, torch.autograd.grad(ge.sum(), xe)[0])
