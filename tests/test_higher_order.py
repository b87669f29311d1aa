"""create_graph=True through compiled functions, against eager (docs/higher-order.md).

Every test runs the same computation eagerly and through aotgrad and compares values and
gradients of every order; float64 where the comparison is tight.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotgrad
from aotgrad.testing import VerificationError, verify

torch.set_default_dtype(torch.float32)


def _close(a: Any, b: Any, **kw: Any) -> None:
    torch.testing.assert_close(a, b, **kw)


def _derivatives(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n: int) -> list[Any]:
    """d^k/dx^k of sum(f(x)) for k = 1..n, each with create_graph=True."""
    out, found = f(x).sum(), []
    for _ in range(n):
        (out,) = torch.autograd.grad(out, x, create_graph=True)
        found.append(out)
        out = out.sum()
    return found


def test_third_and_fourth_derivatives_of_sin():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    f = aotgrad.aot_function(torch.sin)
    got = _derivatives(f, x, 4)
    want = [x.cos(), -x.sin(), -x.cos(), x.sin()]
    for g, w in zip(got, want, strict=True):
        _close(g, w.detach())
        assert g.requires_grad
    info = aotgrad.cache_info(f)
    assert (info.create_graph_captures, info.create_graph_fallbacks) == (4, 0)
    _derivatives(f, x, 4)  # the captures are cached
    assert aotgrad.cache_info(f).create_graph_captures == 4


def test_the_cached_differentiable_backward_stays_right_on_new_values():
    f = aotgrad.aot_function(lambda x, w: torch.tanh(x @ w))
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
        (gx,) = torch.autograd.grad(f(x, w).sum(), x, create_graph=True)
        got = torch.autograd.grad(gx.pow(2).sum(), (x, w))
        (ex,) = torch.autograd.grad(torch.tanh(x @ w).sum(), x, create_graph=True)
        _close(got, torch.autograd.grad(ex.pow(2).sum(), (x, w)))
    assert aotgrad.cache_info(f).create_graph_captures == 1


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.gelu(torch.tanh(x @ w1)) @ w2


def _mlp_inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return (
        torch.randn(6, 3, dtype=torch.float64),
        torch.randn(3, 5, dtype=torch.float64),
        torch.randn(5, 2, dtype=torch.float64),
    )


def test_hvp_and_hessian_of_an_mlp_loss():
    x, w1, w2 = _mlp_inputs()
    f = aotgrad.aot_function(_mlp)

    def loss(w: torch.Tensor, run: Callable[..., torch.Tensor]) -> torch.Tensor:
        return run(x, w, w2).pow(2).sum()

    v = torch.randn_like(w1)
    got = torch.autograd.functional.hvp(lambda w: loss(w, f), w1, v)
    want = torch.autograd.functional.hvp(lambda w: loss(w, _mlp), w1, v)
    _close(got, want)
    _close(
        torch.autograd.functional.hessian(lambda w: loss(w, f), w1),
        torch.autograd.functional.hessian(lambda w: loss(w, _mlp), w1),
    )
    # by hand: the gradient, then the gradient of its dot product with v
    w = w1.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(w, f), w, create_graph=True)
    (manual,) = torch.autograd.grad((g * v).sum(), w)
    _close(manual, want[1])


def test_cotangents_that_require_grad_are_differentiated():
    """``torch.autograd.functional.vhp``/``hvp`` differentiate the gradient by its cotangent."""
    x, w1, w2 = _mlp_inputs()
    x.requires_grad_(True)
    f = aotgrad.aot_function(_mlp)
    runs = []
    for run in (_mlp, f):
        u = torch.ones(6, 2, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(run(x, w1, w2), x, u, create_graph=True)
        runs.append(torch.autograd.grad(g.pow(2).sum(), (x, u)))
    _close(runs[1], runs[0])


def test_pinn_second_derivative_of_the_output_by_the_input():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    net = net.double()
    eager, compiled = net, aotgrad.aot_module(copy.deepcopy(net))
    x = torch.linspace(0, 1, 11, dtype=torch.float64).unsqueeze(1)

    def residual(model: nn.Module) -> torch.Tensor:
        xs = x.clone().requires_grad_(True)
        u = model(xs)
        (du,) = torch.autograd.grad(u.sum(), xs, create_graph=True)
        (d2u,) = torch.autograd.grad(du.sum(), xs, create_graph=True)
        loss = (d2u + torch.pi**2 * torch.sin(torch.pi * xs)).pow(2).mean()
        loss.backward()
        return d2u

    _close(residual(compiled), residual(eager))
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        _close(p.grad, q.grad)


class _Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 32),
            nn.LeakyReLU(0.2),
            nn.Linear(32, 32),
            nn.LeakyReLU(0.2),
            nn.Linear(32, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def wgan_gp_step(
    critic: nn.Module,
    opt: torch.optim.Optimizer,
    real: torch.Tensor,
    fake: torch.Tensor,
    alpha: torch.Tensor,
) -> torch.Tensor:
    """One critic step of WGAN-GP: the Wasserstein loss plus the gradient penalty."""
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
    penalty = (grad.norm(2, dim=1) - 1).pow(2).mean()
    loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def test_wgan_gp_steps_match_eager():
    torch.manual_seed(0)
    eager = _Critic().double()
    compiled_model = copy.deepcopy(eager)
    compiled = aotgrad.aot_module(compiled_model)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (eager, compiled_model)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        real, fake = (torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(2))
        alpha = torch.rand(8, 1, generator=g, dtype=torch.float64)
        want = wgan_gp_step(eager, opts[0], real, fake, alpha)
        got = wgan_gp_step(compiled, opts[1], real, fake, alpha)
        _close(got, want)
        for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
            _close(p.grad, q.grad)  # the penalty's second-order terms included
    for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        _close(p, q)
    assert aotgrad.cache_info(compiled).create_graph_captures == 1


def test_maml_inner_step_over_an_aot_module_with_functional_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    eager, compiled = model, aotgrad.aot_module(copy.deepcopy(model))
    x, y, xq, yq = (torch.randn(5, k, dtype=torch.float64) for k in (3, 1, 3, 1))

    def meta_loss(m: nn.Module) -> torch.Tensor:
        params = dict(m.named_parameters())
        inner = (functional_call(m, params, (x,)) - y).pow(2).mean()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads, strict=True)}
        outer = (functional_call(m, fast, (xq,)) - yq).pow(2).mean()
        outer.backward()
        return outer.detach()

    _close(meta_loss(compiled), meta_loss(eager))
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert p.grad is not None
        _close(p.grad, q.grad)


def _counter(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    n.add_(1)  # a counter: the saved n + 1 depends on no input requiring grad
    return x.sin() * n


def _scaled_in_place(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y.mul_(2)  # the saved 2 * y is a constant: G reads it, not y
    return (y * x).sin()


def _views(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.view(-1), x.t(), (x * 2).exp()[0]


def _in_place_on_a_copy(x: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.mul_(2)
    return y.sin()


# Mutation, aliasing and saved random values under create_graph (checked by verify).
_CREATE_GRAPH_CASES: dict[str, Callable[[], tuple[Any, ...]]] = {
    "counter": lambda: (_counter, torch.randn(3, requires_grad=True), torch.zeros(3)),
    "view-outputs": lambda: (_views, torch.randn(2, 3, requires_grad=True)),
    "in-place-on-an-input": lambda: (
        _scaled_in_place,
        torch.randn(3, requires_grad=True),
        torch.randn(3),
    ),
    "in-place": lambda: (_in_place_on_a_copy, torch.randn(3, requires_grad=True)),
    "batchnorm-train": lambda: (
        nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Softplus()).train(),
        torch.randn(5, 3, requires_grad=True),
    ),
    "dropout-mask-saved": lambda: (
        nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1)),
        torch.randn(5, 4, requires_grad=True),
    ),
    "random-draw-saved": lambda: (
        lambda x: (x * torch.rand(3)).sin(),
        torch.randn(3, requires_grad=True),
    ),
}


def _cases(*names: str) -> Any:
    return pytest.mark.parametrize("make", [_CREATE_GRAPH_CASES[n] for n in names], ids=names)


@_cases(*_CREATE_GRAPH_CASES)
def test_mutation_aliasing_and_dropout_under_create_graph_match_eager(make):
    torch.manual_seed(0)
    fn, *args = make()
    report = verify(fn, *args, create_graph=True)
    assert report.compared_grads >= 2


def test_verify_create_graph_catches_a_wrong_second_derivative():
    """A compiler whose second derivative is wrong must fail verify (the check can fail)."""

    def wrong(fn: Callable[..., Any]) -> Callable[..., Any]:
        class Detached(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(x)
                return x.sin()

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                (x,) = ctx.saved_tensors
                return g * x.detach().cos()  # no path to x: second derivative lost

        return Detached.apply

    with pytest.raises(VerificationError, match="second-order grad of x"):
        verify(
            lambda x: x.sin(),
            torch.randn(3, requires_grad=True),
            create_graph=True,
            compile_fn=wrong,
        )


def test_an_input_changed_in_place_that_the_second_derivative_reads_is_refused():
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = (x + y).sin()  # saves x + y: recomputing it needs y's old value
        y.add_(1)
        return out

    compiled = aotgrad.aot_function(f)
    x = torch.randn(3, requires_grad=True)
    out = compiled(x, torch.randn(3))
    with pytest.raises(aotgrad.DoubleBackwardError, match=r"input y .*changed that input in place"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(compiled(x, torch.zeros(3)).sum(), x)  # first order still works
    _close(g, x.cos().detach())


def test_a_backward_op_with_no_derivative_names_the_op_and_the_line():
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="flash_attention_for_cpu_backward"):  # eager too
        (g,) = torch.autograd.grad(attention(q, k, v).sum(), q, create_graph=True)
        g.sum().backward()
    f = aotgrad.aot_function(attention)
    with pytest.raises(
        aotgrad.DoubleBackwardError,
        match=r"(?s)_scaled_dot_product_flash_attention_for_cpu_backward.*"
        r"test_higher_order.py:\d+ in attention: return F.scaled_dot_product_attention",
    ):
        torch.autograd.grad(f(q, k, v).sum(), q, create_graph=True)


def _copied_into_a_transpose(x: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(4, 3).t()  # a non-contiguous intermediate written by copy_
    y.copy_(x.sin())
    return (y * x).exp()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (nn.SiLU(), torch.randn(5, requires_grad=True)), id="silu"),
        pytest.param(lambda: (nn.Mish(), torch.randn(5, requires_grad=True)), id="mish"),
        pytest.param(
            lambda: (
                nn.Sequential(nn.Linear(3, 4), nn.SiLU(inplace=True), nn.Linear(4, 2)),
                torch.randn(2, 3, requires_grad=True),
            ),
            id="silu-inplace-mlp",
        ),
        pytest.param(
            lambda: (_copied_into_a_transpose, torch.randn(3, 4, requires_grad=True)),
            id="copy-into-a-transpose",
        ),
    ],
)
def test_backward_ops_without_a_derivative_are_decomposed(make):
    # Note [Backward ops without a derivative]: eager differentiates these under create_graph
    torch.manual_seed(0)
    fn, *args = make()
    report = verify(fn, *args, create_graph=True)
    assert report.compared_grads >= 1


def test_third_derivative_through_silu():
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    f = aotgrad.aot_function(F.silu)
    for got, want in zip(_derivatives(f, x, 3), _derivatives(F.silu, x, 3), strict=True):
        _close(got, want)


@pytest.mark.parametrize("name", ["llama", "convnext"])
def test_gradient_penalty_of_models_with_silu_and_copies(name):
    library_models = pytest.importorskip("library_models")
    case = library_models.build(name)
    eager = case.model.double()
    compiled_model = copy.deepcopy(eager)
    compiled = aotgrad.aot_module(compiled_model)
    args = tuple(a.double() if a.is_floating_point() else a for a in case.args)
    for run, model in ((eager, eager), (compiled, compiled_model)):
        torch.manual_seed(0)
        params = [p for p in model.parameters() if p.requires_grad]
        with sdpa_kernel(SDPBackend.MATH):  # CPU flash attention has no second derivative
            loss = case.loss(run(*args, **case.kwargs))
            grads = torch.autograd.grad(loss, params, create_graph=True)
            sum(g.pow(2).sum() for g in grads).backward()
    for (name_, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        scale = float(q.grad.abs().max())
        _close(p.grad, q.grad, rtol=1e-6, atol=1e-9 * scale + 1e-12, msg=name_)


def _doubled_through_an_alias(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
    a.mul_(2)  # a and b share memory: the graph writes into their base (as_strided_scatter)
    return (a,)


def _written_under_no_grad_through_an_alias(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor]:
    a.add_(a.mean())
    with torch.no_grad():
        c.add_(a.mean())
    return (a,)


@pytest.mark.parametrize(
    "fn, make",
    [
        (_doubled_through_an_alias, lambda b: (b.t(), b)),
        (_written_under_no_grad_through_an_alias, lambda b: (b.t(), b, b.t())),
    ],
    ids=["doubled", "no-grad-write"],
)
def test_writes_into_a_shared_base_under_create_graph(fn, make):
    # found by the fuzzer under create_graph: the second-order gradient of the cotangent
    # was wrong through as_strided_scatter's derivative (Note [Backward ops without a derivative])
    torch.manual_seed(0)
    base = torch.randn(3, 3, requires_grad=True)
    verify(fn, *make(base), create_graph=True)


@pytest.mark.parametrize(
    "size, stride, offset, transposed",
    [([2], [1], 3, False), ([3, 3], [1, 3], 0, False), ([2, 2], [4, 1], 1, True)],
)
def test_as_strided_scatter_as_g_runs_it_is_twice_differentiable(size, stride, offset, transposed):
    from aotgrad.ops.differentiable import as_strided_scatter

    numel = 16 if transposed or size == [2] else 9
    a = torch.randn(numel, dtype=torch.float64, requires_grad=True)
    src = torch.randn(*size, dtype=torch.float64, requires_grad=True)

    def scatter(a: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        target = a.view(4, 4).t() if transposed else a
        return as_strided_scatter(target, src, size, stride, offset)

    target = a.detach().view(4, 4).t() if transposed else a.detach()
    want = torch.ops.aten.as_strided_scatter(target, src.detach(), size, stride, offset)
    got = scatter(a, src)
    assert torch.equal(got, want) and got.stride() == want.stride()
    assert torch.autograd.gradcheck(scatter, (a, src))
    assert torch.autograd.gradgradcheck(scatter, (a, src))


def test_a_random_op_the_second_derivative_would_recompute_is_refused():
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + torch.rand(3)).sin()  # the sum is saved, not the draw: recomputing redraws

    compiled = aotgrad.aot_function(f)
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(aotgrad.DoubleBackwardError, match=r"random op aten\.rand"):
        torch.autograd.grad(compiled(x).sum(), x, create_graph=True)


def test_through_torch_compile_and_a_trace_callable():
    torch.manual_seed(0)
    model = _Critic().double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def penalty_grads(
        run: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor]
    ) -> Any:
        (g,) = torch.autograd.grad(run(x).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), [x, *params], allow_unused=True)

    params = list(model.parameters())
    want = penalty_grads(model, params)
    got = penalty_grads(torch.compile(model, backend="aotgrad"), params)
    _close(got, want)
    traced = aotgrad.trace(model, x)
    _close(penalty_grads(traced, params), want)


@pytest.mark.parametrize("partition", ["save_all", "mincut", aotgrad.budget(0.5)], ids=str)
def test_partitions(partition):
    torch.manual_seed(0)
    x, w1, w2 = (t.requires_grad_(True) for t in _mlp_inputs())
    f = aotgrad.aot_function(_mlp, partition=partition)
    runs = []
    for run in (_mlp, f):
        (gx, gw) = torch.autograd.grad(run(x, w1, w2).pow(2).sum(), (x, w1), create_graph=True)
        runs.append(torch.autograd.grad((gx.sum() + gw.pow(3).sum()), (x, w1, w2)))
    _close(runs[1], runs[0])


def test_a_library_models_gradient_penalty():
    library_models = pytest.importorskip("library_models")
    case = library_models.build("resnet18")
    eager = case.model.double()  # float64: the penalty's gradients reach 1e10
    compiled_model = copy.deepcopy(eager)
    compiled = aotgrad.aot_module(compiled_model)
    (images, *_), kwargs = case.args, case.kwargs
    for run in (eager, compiled):
        torch.manual_seed(0)
        x = images.double().requires_grad_(True)
        (g,) = torch.autograd.grad(
            case.loss(run(x, *case.args[1:], **kwargs)), x, create_graph=True
        )
        g.pow(2).sum().backward()
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        scale = float(q.grad.abs().max())  # entries near zero are rounding noise at 1e8
        _close(p.grad, q.grad, rtol=1e-7, atol=1e-10 * scale, msg=name)
    for p, q in zip(compiled_model.buffers(), eager.buffers(), strict=True):
        _close(p, q)


def _sin_times_x(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * x


def test_the_disk_cache_keeps_higher_order_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "1")
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", os.fspath(tmp_path))
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (eg,) = torch.autograd.grad(_sin_times_x(x).sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(eg.sum(), x)
    for disk_hits in (0, 1):
        f = aotgrad.aot_function(_sin_times_x)
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x)
        _close(h, want)
        assert aotgrad.cache_info(f).disk_hits == disk_hits


def test_a_kept_input_changed_after_the_call_is_refused():
    """``x`` is not saved (the product is), so it is kept with its version (Note [Primals in
    the backward]); changed before the create_graph backward, it no longer holds the value."""
    f = aotgrad.aot_function(lambda x: (x * 2).sin())
    root = torch.randn(3, requires_grad=True)
    x = root * 1
    out = f(x)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(aotgrad.DoubleBackwardError, match=r"input x .*changed in place since"):
        torch.autograd.grad(out.sum(), root, create_graph=True)
    (g,) = torch.autograd.grad(f(x).sum(), root)  # first order never reads it
    _close(g, 2 * (2 * x).cos().detach())


def test_one_cotangent_for_two_outputs_then_two_cotangents():
    """The capture of G specializes on which inputs are one tensor: so does its cache."""

    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), x.cos()

    f = aotgrad.aot_function(two)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    g1, g2 = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for cotangents in ((g1, g1), (g1, g2), (g2, g2)):
        runs = []
        for run in (two, f):
            (gx,) = torch.autograd.grad(run(x), x, cotangents, create_graph=True)
            runs.append((gx, *torch.autograd.grad(gx.sum(), x)))
        _close(runs[1], runs[0])


def test_a_forward_under_autocast():
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).float()

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    runs = []
    for run in (f, aotgrad.aot_function(f)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(x, w)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        runs.append((g, *torch.autograd.grad(g.pow(2).sum(), (x, w))))
    _close(runs[1], runs[0])


def _traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``trace`` on the call's own arguments, then the ``Traced`` callable."""

    def run(*args: Any) -> Any:
        return aotgrad.trace(fn, *args)(*args)

    return run


def _dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, backend="aotgrad")


@pytest.mark.parametrize("frontend", [_traced, _dynamo], ids=["trace", "torch.compile"])
@_cases("counter", "view-outputs", "in-place-on-an-input", "batchnorm-train")
def test_mutation_and_aliasing_through_other_frontends(make, frontend):
    torch.manual_seed(0)
    fn, *args = make()
    report = verify(fn, *args, create_graph=True, compile_fn=frontend)
    assert report.compared_grads >= 2


def test_a_missing_cotangent_becomes_zeros_under_create_graph():
    def two(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ w).sin(), (x * 3).cos()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    runs = []
    for run in (two, aotgrad.aot_function(two)):
        first, _ = run(x, w)  # the second output gets no cotangent
        (gx,) = torch.autograd.grad(first.sum(), x, create_graph=True)
        runs.append((gx, *torch.autograd.grad(gx.pow(2).sum(), (x, w))))
    _close(runs[1], runs[0])


def _recording(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    return compiler


def _count(gm: torch.fx.GraphModule, *names: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in names)


_MATMULS = ("aten.mm.default", "aten.addmm.default")


def test_g_computes_only_the_gradients_asked_for_and_recomputes_no_matmul():
    """Note [Only the gradients asked for], Note [Saved values read as masks]: for
    ``autograd.grad(..., x)`` the gradient penalty's G runs the two matmuls eager's
    double backward runs, not the weights' gradients nor the forward again."""
    torch.manual_seed(0)
    eager = _Critic().double()
    forwards: list[torch.fx.GraphModule] = []
    compiled = aotgrad.aot_module(
        copy.deepcopy(eager), fw_compiler=_recording(forwards), bw_compiler=aotgrad.nop
    )
    x = torch.randn(8, 4, dtype=torch.float64)
    runs = []
    for model in (eager, compiled):
        mixed = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(mixed).sum(), mixed, create_graph=True)
        (grad.norm(2, dim=1) - 1).pow(2).mean().backward()
        runs.append((grad, mixed.grad, *(p.grad for p in model.parameters())))
    _close(runs[1], runs[0])  # mixed.grad: zeros, as eager's
    first, g = forwards  # the first order's forward, then G's
    assert _count(first, *_MATMULS) == 3
    assert _count(g, *_MATMULS) == 3  # g @ W3.T, then @ W2.T, then @ W1.T
    assert _count(g, "aten.sum.dim_IntList") == 0  # no bias gradient


def test_one_compiled_model_under_each_mask_matches_eager():
    """The same compiled model asked for x's gradient, then the parameters', then all of
    them by backward: one G per mask (Note [Only the gradients asked for])."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    eager = eager.double()
    compiled_model = copy.deepcopy(eager)
    compiled = aotgrad.aot_module(compiled_model)
    x = torch.randn(5, 3, dtype=torch.float64)

    def steps(model: nn.Module) -> list[Any]:
        params = list(model.parameters())
        xs = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(model(xs).sum(), xs, create_graph=True)
        found = [gx, *torch.autograd.grad(gx.pow(2).sum(), [xs, *params], allow_unused=True)]
        gps = torch.autograd.grad(model(xs).sum(), params, create_graph=True)
        penalty = sum(g.pow(2).sum() for g in gps)
        found += [*gps, *torch.autograd.grad(penalty, [xs, *params], allow_unused=True)]
        for p in params:
            p.grad = None
        (gx2,) = torch.autograd.grad(model(xs).sum(), xs, create_graph=True)
        (gx2.pow(2).sum() + model(xs).sum()).backward()
        return [*found, gx2, xs.grad, *(p.grad for p in params)]

    _close(steps(compiled), steps(eager))
    assert (
        aotgrad.cache_info(compiled).create_graph_captures == 2
    )  # asked for x; for the parameters


def test_a_bias_reached_only_through_relu_masks_gets_zeros_as_in_eager():
    """Note [Saved values read as masks]: the penalty reaches ``0.bias`` and the input only
    through ReLU's mask; eager gives them zeros, not None, and SGD's weight decay moves
    the bias only when its gradient is a tensor."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    compiled_model = copy.deepcopy(eager)
    compiled = aotgrad.aot_module(compiled_model)
    x = torch.randn(6, 4, dtype=torch.float64)
    for model, params in ((eager, eager), (compiled, compiled_model)):
        opt = torch.optim.SGD(params.parameters(), lr=0.1, weight_decay=0.5)
        xs = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(model(xs).sum(), xs, create_graph=True)
        gx.pow(2).sum().backward()
        assert xs.grad is not None and not xs.grad.any()
        assert params[0].bias.grad is not None and not params[0].bias.grad.any()
        opt.step()
    for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        _close(p, q)
        _close(p.grad, q.grad)


def test_third_order_through_relu_masks_reaches_what_eager_reaches():
    """Note [Saved values read as masks]: under create_graph the zeros sent through a mask are
    themselves differentiable in the inputs the mask came from, as eager's are."""
    torch.manual_seed(0)
    w1 = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(8, 1, dtype=torch.float64, requires_grad=True)

    def net(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w1) @ w2

    def third(f: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        (g,) = torch.autograd.grad(f(x, w1, w2).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x, create_graph=True)
        return (g, h, *torch.autograd.grad(h.sum(), (x, w1, w2), allow_unused=True))

    got, want = third(aotgrad.aot_function(net)), third(net)
    assert [t is None for t in got] == [t is None for t in want] == [False] * 4 + [True]
    _close(got, want)


def test_a_gradient_through_a_relu_mask_can_be_changed_in_place():
    """The zero links hand on copies, not views, which eager code may change in place."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w)

    runs = []
    for fn in (f, aotgrad.aot_function(f)):
        x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        (g,) = torch.autograd.grad(fn(x, w).sum(), x, create_graph=True)
        g.mul_(2)
        runs.append((g, *torch.autograd.grad(g.pow(2).sum(), (x, w))))
    _close(runs[1], runs[0])
