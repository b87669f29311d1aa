"""torch.func transforms and forward-mode AD through aotgrad-compiled functions, against eager.

Under a transform (or inside ``forward_ad.dual_level``) a compiled function runs the user's
function on the transform's tensors (Note [Transforms run the function]), counted in
``cache_info(f).transform_runs``. Each test runs one transform over an eager model and over a
compiled copy of it, and compares results, gradients, buffers and inputs after the call; the
count shows the compiled path was the one taken. Graphs with no function behind them (a file
loaded with ``aotgrad.load``) raise ``TransformError`` naming the transform.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import aotgrad

RTOL, ATOL = 1e-5, 1e-6


def assert_close(actual: Any, expected: Any) -> None:
    """Same structure, same values (tensors), equal everything else."""
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    assert got_spec == want_spec
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        else:
            assert a == b


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).train()


def runs(f: Any) -> int:
    return aotgrad.cache_info(f).transform_runs


# --------------------------------------------------------------------------- reverse mode


def outcome(run: Callable[[], Any]) -> Any:
    """What ``run`` returns, or the type and message of what it raises."""
    try:
        return run()
    except RuntimeError as e:
        return type(e).__name__, str(e)


def unprefixed(named: dict[str, Any]) -> dict[str, Any]:
    """An aot_module's parameter or buffer names, as the wrapped module's."""
    return {k.removeprefix("orig_module."): v for k, v in named.items()}


@pytest.mark.parametrize("make", [mlp, bn_model], ids=["mlp", "batchnorm_train"])
def test_grad_over_parameters_and_buffers_with_functional_call(
    make: Callable[[], nn.Module],
) -> None:
    """BatchNorm's running stats are handed in, as torch.func requires; they update as eager's."""
    eager = make()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x = torch.randn(5, 3)

    def loss(model: nn.Module) -> Callable[..., torch.Tensor]:
        def run(params: dict[str, Any], buffers: dict[str, Any], x: torch.Tensor) -> Any:
            return functional_call(model, (params, buffers), (x,)).pow(2).sum()

        return run

    results = []
    for model in (eager, compiled):
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        results.append((unprefixed(grad(loss(model))(params, buffers, x)), unprefixed(buffers)))
    assert_close(results[1], results[0])
    if make is bn_model:
        assert not torch.equal(results[1][1]["1.running_mean"], torch.zeros(4))
    assert runs(compiled) == 1


@pytest.mark.parametrize("make", [mlp, bn_model], ids=["mlp", "batchnorm_train"])
def test_grad_vjp_jacrev_over_the_input(make: Callable[[], nn.Module]) -> None:
    """BatchNorm in train mode mutates a buffer the transform did not get: both raise alike."""
    eager = make()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x, cotangent = torch.randn(5, 3), torch.randn(5, eager[-1].out_features)
    for model in (eager, compiled):  # the compiled path is the usual one outside transforms
        model(x).sum().backward()
    results = []
    for model in (eager, compiled):

        def transforms(m: nn.Module = model) -> Any:
            out, pullback = vjp(m, x)
            return grad(lambda x: m(x).sin().sum())(x), out, pullback(cotangent), jacrev(m)(x)

        results.append((outcome(transforms), unprefixed(dict(model.named_buffers()))))
    assert_close(results[1], results[0])
    assert runs(compiled) >= 1
    assert aotgrad.cache_info(compiled).misses == 1  # the plain call before: one trace


def test_nested_grad_to_third_order() -> None:
    f = aotgrad.aot_function(torch.sin)
    x = torch.tensor(0.7)
    assert_close(grad(grad(f))(x), -torch.sin(x))
    assert_close(grad(grad(grad(f)))(x), -torch.cos(x))
    assert runs(f) == 2


def test_nested_grad_of_an_mlp_loss() -> None:
    eager = mlp()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x = torch.randn(3)

    def hessian_diag(model: nn.Module) -> torch.Tensor:
        first = grad(lambda x: model(x).tanh().sum())
        return jacrev(first)(x).diagonal()

    assert_close(hessian_diag(compiled), hessian_diag(eager))
    assert runs(compiled) == 1


def test_hessian_of_an_mlp_loss_over_its_parameters() -> None:
    eager = mlp()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x = torch.randn(4, 3)

    def hessian(model: nn.Module, prefix: str) -> Any:
        weight = dict(model.named_parameters())[prefix + "2.weight"].detach()

        def loss(w: torch.Tensor) -> torch.Tensor:
            return functional_call(model, {prefix + "2.weight": w}, (x,)).tanh().sum()

        return torch.func.hessian(loss)(weight)

    assert_close(hessian(compiled, "orig_module."), hessian(eager, ""))
    assert runs(compiled) == 1


def test_grad_of_a_function_mutating_an_input_it_is_not_differentiated_for() -> None:
    def f(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scale.mul_(2)
        return (x * scale).sin().sum()

    compiled = aotgrad.aot_function(f)
    x = torch.randn(4)
    scales = torch.ones(4), torch.ones(4)
    want = grad(f)(x, scales[0])
    got = grad(compiled)(x, scales[1])
    assert_close(got, want)
    assert_close(scales[1], scales[0])  # mutated as eager mutates it
    assert scales[1].tolist() == [2.0] * 4


def test_grad_of_a_function_mutating_the_differentiated_input_raises_as_eager() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()

    with pytest.raises(RuntimeError) as eager_error:
        grad(f)(torch.ones(2))
    with pytest.raises(RuntimeError) as compiled_error:
        grad(aotgrad.aot_function(f))(torch.ones(2))
    assert str(compiled_error.value) == str(eager_error.value)


def test_vjp_of_a_view_returning_function() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t(), x[0]

    compiled = aotgrad.aot_function(f)
    x = torch.randn(2, 3)
    cotangents = (torch.randn(3, 2), torch.randn(3))
    want_out, want_pullback = vjp(f, x)
    got_out, got_pullback = vjp(compiled, x)
    assert_close(got_out, want_out)
    assert_close(got_pullback(cotangents), want_pullback(cotangents))
    assert_close(jacrev(compiled)(x), jacrev(f)(x))


def test_grad_through_a_trace_and_through_the_torch_compile_backend() -> None:
    model = mlp()
    x = torch.randn(4, 3)
    traced = aotgrad.trace(model, x)
    compiled = torch.compile(model, backend="aotgrad")
    want = grad(lambda x: model(x).sum())(x)
    assert_close(grad(lambda x: traced(x).sum())(x), want)
    assert_close(grad(lambda x: compiled(x).sum())(x), want)
    assert traced.transform_runs == 1


def test_transformers_model_vjp_over_input_embeddings() -> None:
    library_models = pytest.importorskip("library_models")
    case = library_models.build("bert")
    eager = case.model.eval()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    kwargs = {k: v for k, v in case.kwargs.items() if k not in ("input_ids", "labels")}
    embeds = eager.get_input_embeddings()(case.kwargs["input_ids"]).detach()

    def logits(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda e: model(inputs_embeds=e, **kwargs).logits

    cotangent = torch.randn_like(logits(eager)(embeds))
    want_out, want_pullback = vjp(logits(eager), embeds)
    got_out, got_pullback = vjp(logits(compiled), embeds)
    assert_close(got_out, want_out)
    assert_close(got_pullback(cotangent), want_pullback(cotangent))
    assert runs(compiled) == 1


# --------------------------------------------------------------------------- forward mode


@pytest.mark.parametrize("make", [mlp, bn_model], ids=["mlp", "batchnorm_train"])
def test_jvp_and_jacfwd(make: Callable[[], nn.Module]) -> None:
    eager = make()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x, tangent = torch.randn(5, 3), torch.randn(5, 3)
    results = []
    for model in (eager, compiled):

        def transforms(m: nn.Module = model) -> Any:
            return jvp(m, (x,), (tangent,)), jacfwd(m)(x)

        results.append((outcome(transforms), unprefixed(dict(model.named_buffers()))))
    assert_close(results[1], results[0])
    assert runs(compiled) >= 1


def test_jacfwd_matches_jacrev_of_a_view_returning_function() -> None:
    compiled = aotgrad.aot_function(lambda x: x.view(-1)[1:].exp())
    x = torch.randn(2, 2)
    assert_close(jacfwd(compiled)(x), jacrev(compiled)(x))
    assert_close(jacfwd(compiled)(x), jacfwd(lambda x: x.view(-1)[1:].exp())(x))


def dual_call(fn: Callable[..., Any], *args: Any, tangent: torch.Tensor) -> Any:
    """``fn(make_dual(args[0], tangent), *args[1:])``: the result's (primal, tangent) pairs."""
    with fwAD.dual_level():
        out = fn(fwAD.make_dual(args[0], tangent), *args[1:])
        return pytree.tree_map_only(torch.Tensor, lambda t: tuple(fwAD.unpack_dual(t)), out)


@pytest.mark.parametrize("make", [mlp, bn_model], ids=["mlp", "batchnorm_train"])
def test_forward_ad_dual_tensors(make: Callable[[], nn.Module]) -> None:
    """The MLP runs a captured JVP graph; BatchNorm's capture refuses, so it runs the module."""
    eager = make()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x, tangent = torch.randn(5, 3), torch.randn(5, 3)
    for _ in range(2):
        want = dual_call(eager, x, tangent=tangent)
        assert_close(dual_call(compiled, x, tangent=tangent), want)
    assert_close(unprefixed(dict(compiled.named_buffers())), dict(eager.named_buffers()))
    info = aotgrad.cache_info(compiled)
    if make is mlp:
        assert (info.jvp_runs, info.transform_runs, info.jvp_skipped) == (2, 0, None)
        (jvp,) = compiled.compiled._jvps.values()
        assert aotgrad.cache_info(jvp).misses == 1  # traced once, then a hit
    else:
        assert (info.jvp_runs, info.transform_runs) == (0, 2)
        assert "last JVP graph not captured: UnsupportedMutationError" in str(info)


def test_the_jvp_graph_keeps_detach_and_runs_the_users_compiler() -> None:
    """Note [Forward mode captures a JVP graph]: its example, through a counting compiler."""
    graphs = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * x.cos().detach()

    compiled = aotgrad.aot_function(f, compiler)
    x, tangent = torch.randn(4), torch.randn(4)
    got = dual_call(compiled, x, tangent=tangent)
    assert_close(got, dual_call(f, x, tangent=tangent))
    assert_close(got[1], x.cos() * tangent * x.cos())
    assert graphs  # the JVP graph went through the user's compiler
    assert aotgrad.cache_info(compiled).jvp_runs == 1


def test_reverse_mode_over_a_dual_call() -> None:
    eager = mlp()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    tangent = torch.randn(5, 3)
    grads = []
    for model in (eager, compiled):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with fwAD.dual_level():
            primal, out_tangent = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent)))
            (primal.sum() + out_tangent.sum()).backward()
        grads.append((x.grad, [p.grad for p in model.parameters()]))
    assert_close(grads[1], grads[0])
    assert aotgrad.cache_info(compiled).jvp_runs == 1


def test_forward_ad_with_non_tensor_outputs_and_arguments() -> None:
    def f(x: torch.Tensor, scale: float, w: torch.Tensor) -> tuple[Any, ...]:
        return (x * scale).tanh() @ w, x.shape[0], None, w * 2

    compiled = aotgrad.aot_function(f)
    x, w, tangent = torch.randn(2, 3), torch.randn(3, 3), torch.randn(2, 3)
    assert_close(
        dual_call(compiled, x, 0.5, w, tangent=tangent), dual_call(f, x, 0.5, w, tangent=tangent)
    )
    assert aotgrad.cache_info(compiled).jvp_runs == 1


def test_forward_ad_through_custom_functions() -> None:
    class WithJvp(torch.autograd.Function):
        @staticmethod
        def forward(x: torch.Tensor) -> torch.Tensor:
            return x.exp()

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            ctx.save_for_forward(output)

        @staticmethod
        def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:
            return 3 * tangent  # not exp's derivative: the rule must come from here

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    class WithoutJvp(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    x, tangent = torch.randn(3), torch.randn(3)
    with_jvp = aotgrad.aot_function(lambda x: WithJvp.apply(x).sin())
    got = dual_call(with_jvp, x, tangent=tangent)
    assert_close(got, dual_call(lambda x: WithJvp.apply(x).sin(), x, tangent=tangent))
    without = aotgrad.aot_function(lambda x: WithoutJvp.apply(x))
    with pytest.raises(RuntimeError, match="jvp") as eager_error:
        dual_call(lambda x: WithoutJvp.apply(x), x, tangent=tangent)
    with pytest.raises(RuntimeError) as compiled_error:
        dual_call(without, x, tangent=tangent)
    assert str(compiled_error.value) == str(eager_error.value)


def test_forward_ad_through_a_view_and_an_input_mutation() -> None:
    def f(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(x * 2)
        return acc[1:]

    compiled = aotgrad.aot_function(f)
    results = []
    for fn in (f, compiled):
        x, acc = torch.ones(3), torch.zeros(3)
        with fwAD.dual_level():
            dual_acc = fwAD.make_dual(acc, torch.zeros(3))
            out = fn(fwAD.make_dual(x, torch.arange(3.0)), dual_acc)
            out.mul_(10)  # through the view into acc, as in eager
            results.append((tuple(fwAD.unpack_dual(out)), tuple(fwAD.unpack_dual(dual_acc))))
    assert_close(results[1], results[0])
    assert results[1][1][0].tolist() == [2.0, 20.0, 20.0]  # acc, changed through the view
    assert results[1][1][1].tolist() == [0.0, 20.0, 40.0]  # and its tangent
    assert aotgrad.cache_info(compiled).jvp_runs == 1


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.no_grad])
def test_forward_ad_mutating_a_plain_input_and_outputs_without_tangents(mode: Any) -> None:
    """``no_grad`` does not stop forward mode; argmax and detach() outputs get no tangent."""

    def f(x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        buf.add_(1)
        return x.sin() * buf, x.argmax(), x.detach() * 2

    compiled = aotgrad.aot_function(f)
    x, tangent = torch.randn(4), torch.randn(4)
    results = []
    for fn in (f, compiled):
        buf = torch.ones(4)
        with mode():
            results.append((dual_call(fn, x, buf, tangent=tangent), buf))
    assert_close(results[1], results[0])
    assert results[1][0][1][1] is None and results[1][0][2][1] is None
    assert results[1][1].tolist() == [2.0] * 4
    assert aotgrad.cache_info(compiled).jvp_runs == 1


def test_dual_parameters_run_the_module() -> None:
    """functional_call with dual parameters: capture would drop their tangents."""
    eager = mlp()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x = torch.randn(5, 3)
    results = []
    for model, prefix in ((eager, ""), (compiled, "orig_module.")):
        with fwAD.dual_level():
            params = {
                prefix + k: fwAD.make_dual(v.detach(), torch.ones_like(v))
                for k, v in eager.named_parameters()
            }
            out = functional_call(model, params, (fwAD.make_dual(x, torch.ones_like(x)),))
            results.append(tuple(fwAD.unpack_dual(out)))
    assert_close(results[1], results[0])
    assert aotgrad.cache_info(compiled).transform_runs == 1


def test_a_dual_level_with_no_dual_input_still_matches_eager() -> None:
    compiled = aotgrad.aot_function(lambda x: x.cos())
    x = torch.randn(3, requires_grad=True)
    with fwAD.dual_level():
        out = compiled(x)
    out.sum().backward()
    assert_close(x.grad, -x.detach().sin())


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_forward_ad_through_a_transformers_model(frozen: bool) -> None:
    """Frozen: a JVP graph. Trainable: capture of the JVP graph's backward may refuse (the
    function runs; docs/known-limitations.md)."""
    library_models = pytest.importorskip("library_models")
    case = library_models.build("bert")
    eager = case.model.eval().requires_grad_(not frozen)
    eager.set_attn_implementation("eager")  # torch has no forward-mode rule for CPU SDPA
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    kwargs = {k: v for k, v in case.kwargs.items() if k not in ("input_ids", "labels")}
    embeds = eager.get_input_embeddings()(case.kwargs["input_ids"]).detach()
    tangent = torch.randn_like(embeds)

    def logits(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda e: model(inputs_embeds=e, **kwargs).logits

    assert_close(
        dual_call(logits(compiled), embeds, tangent=tangent),
        dual_call(logits(eager), embeds, tangent=tangent),
    )
    info = aotgrad.cache_info(compiled)
    assert info.jvp_runs + info.transform_runs == 1
    if frozen:
        assert info.jvp_runs == 1


def test_forward_ad_and_vmap_through_the_torch_compile_backend() -> None:
    model = mlp()
    inputs_seen = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        inputs_seen.append(len(example_inputs))
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=aotgrad.backend(compiler, compiler))
    x, tangent = torch.randn(4, 3), torch.randn(4, 3)
    compiled(x)
    assert_close(dual_call(compiled, x, tangent=tangent), dual_call(model, x, tangent=tangent))
    assert inputs_seen[2] == inputs_seen[0] + 1  # the JVP graph: the tangent is one more input
    assert_close(vmap(compiled)(x.unsqueeze(1)), vmap(model)(x.unsqueeze(1)))
    assert_close(jacfwd(compiled)(x), jacfwd(model)(x))


# --------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("make", [mlp, bn_model], ids=["mlp", "batchnorm_train"])
def test_vmap(make: Callable[[], nn.Module]) -> None:
    eager = make().eval()  # vmap cannot update BatchNorm's running stats per example
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    x = torch.randn(4, 2, 3)
    assert_close(vmap(compiled)(x), vmap(eager)(x))
    assert runs(compiled) == 1


def test_vmap_of_an_input_mutating_view_returning_function() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x[0]

    compiled = aotgrad.aot_function(f)
    xs = torch.randn(4, 3), torch.randn(4, 3)
    xs[1].copy_(xs[0])
    assert_close(vmap(compiled)(xs[1]), vmap(f)(xs[0]))
    assert_close(xs[1], xs[0])  # the batch mutated as eager mutates it


def test_vmap_of_grad_per_example_gradients() -> None:
    eager = mlp()
    compiled = aotgrad.aot_module(copy.deepcopy(eager))
    xs = torch.randn(6, 3)

    def per_example(model: nn.Module) -> torch.Tensor:
        return vmap(grad(lambda x: model(x).pow(2).sum()))(xs)

    assert_close(per_example(compiled), per_example(eager))


# --------------------------------------------------------------------------- outside transforms


def test_calls_outside_transforms_still_run_the_compiled_graphs() -> None:
    f = aotgrad.aot_function(lambda x: x.sin())
    x = torch.randn(3, requires_grad=True)
    f(x)
    grad(lambda x: f(x).sum())(x.detach())
    f(x).sum().backward()
    info = aotgrad.cache_info(f)
    assert (info.misses, info.hits, info.transform_runs) == (1, 1, 1)
    assert "1 calls under torch.func transforms" in str(info)
    assert_close(x.grad, x.detach().cos())


# --------------------------------------------------------------------------- clear errors


@pytest.fixture
def loaded(tmp_path: Any) -> Any:
    traced = aotgrad.trace(lambda x: x.sin(), torch.ones(3, requires_grad=True))
    traced.save(tmp_path / "sin.pt2")
    return aotgrad.load(tmp_path / "sin.pt2")


@pytest.mark.parametrize(
    ("transform", "name"),
    [
        (lambda f, x: grad(lambda x: f(x).sum())(x), "torch.func.grad"),
        (lambda f, x: vmap(f)(x.expand(2, 3)), "torch.func.vmap"),
        (lambda f, x: jvp(f, (x,), (x,)), "torch.func.jvp"),
    ],
    ids=["grad", "vmap", "jvp"],
)
def test_loaded_graphs_refuse_a_transform_by_name(loaded: Any, transform: Any, name: str) -> None:
    with pytest.raises(aotgrad.TransformError, match=name.replace(".", r"\.")):
        transform(loaded, torch.ones(3, requires_grad=True))


def test_loaded_graphs_refuse_dual_tensors(loaded: Any) -> None:
    x = torch.ones(3, requires_grad=True)
    with fwAD.dual_level():
        assert_close(loaded(x), x.sin())  # no tangent: the graphs run
        with pytest.raises(aotgrad.TransformError, match="forward_ad"):
            loaded(fwAD.make_dual(x, torch.ones(3)))


def test_scan_under_grad_and_vmap_runs_unrolled() -> None:
    def body(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c * x.sin(), c.sum()

    xs = torch.randn(4, 3)

    def loss(scan: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda c: scan(body, c, xs)[0].sum() + scan(body, c, xs)[1].sum()

    c0 = torch.randn(3)
    assert_close(grad(loss(aotgrad.scan))(c0), grad(loss(aotgrad.loops.loop.unrolled))(c0))
    batched = torch.randn(2, 3)
    assert_close(
        vmap(lambda c: aotgrad.scan(body, c, xs))(batched),
        vmap(lambda c: aotgrad.loops.loop.unrolled(body, c, xs))(batched),
    )
