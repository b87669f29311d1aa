"""Random draws as program inputs (issue 41, Note [Random draws as inputs]): every draw of the
forward leaves the graph for a draw program torch runs, so Core ATen graphs and backends that
are not torch train with eager's dropout masks, and leave the generator where eager leaves it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import aotgrad
import aotgrad.dynamo
from aotgrad.backends import BACKENDS, step
from aotgrad.errors import ConfigError, UnsupportedOpError
from aotgrad.ops.core_aten import non_core_nodes
from aotgrad.ops.table import is_random
from aotgrad.partition.draws import lift_draws
from aotgrad.runtime.boxing import nop
from aotgrad.signature.descriptors import Draw
from backend_check import check_backend


def _run_torch(program):
    return program.module()


def _compile(backend):
    if backend == "torch":
        return _run_torch
    pytest.importorskip(BACKENDS[backend])
    return backend


BACKEND_PARAMS = [
    "torch",
    pytest.param("onnxruntime", marks=pytest.mark.backends),
    pytest.param("iree", marks=[pytest.mark.backends, pytest.mark.backends_slow]),
]


def _draws_of(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and is_random(n.target)]


def _ops(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


class Recorder:
    """A compiler that keeps every graph it is handed (and runs it as nop does)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return nop(gm, example_inputs)


# Every way a model draws on CPU: dropout on a transposed view (a strided fill), functional
# draws, in-place fills, stochastic depth, the fused op, attention dropout, reseeding.
def _many_draws(x, w):
    h = x @ w
    h = F.dropout(h.t(), 0.2).t()  # a fill of a non-contiguous buffer
    h = h * (torch.rand(h.shape[-1]) < 0.7) + torch.randn_like(h) * 0.01
    h = h + torch.empty_like(h).uniform_(-0.1, 0.1) + torch.empty_like(h).normal_(0, 0.1)
    h = h * h.new_empty(h.shape[0], 1).bernoulli_(0.8).div_(0.8)  # timm's drop_path
    h, _ = torch.native_dropout(h, 0.3, True)
    h = (
        F.alpha_dropout(h, 0.2, True)
        + F.feature_alpha_dropout(h[None, :, :, None], 0.2, True)[0, :, :, 0]
    )
    h = F.dropout2d(h[None, :, :, None], 0.25)[0, :, :, 0]
    q = h.reshape(1, 2, h.shape[0], -1)
    h = h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).reshape(h.shape)
    perm = torch.randperm(h.shape[0])
    return (h[perm] * torch.randint(0, 3, (1, h.shape[1]))).sin()


def _inputs():
    torch.manual_seed(0)
    return torch.randn(6, 4, requires_grad=True), torch.randn(4, 8, requires_grad=True)


def _eager_step(f, args, seed):
    torch.manual_seed(seed)
    out = f(*args)
    grads = torch.autograd.grad(out.sum(), args)
    return out.detach(), grads, torch.get_rng_state()


def test_lifted_forward_equals_eager_bit_for_bit():
    """The draw program makes exactly eager's numbers, the lifted graph computes eager's values
    from them, and the generator ends where eager's does."""
    x, w = _inputs()
    traced = aotgrad.trace(_many_draws, x, w)
    forward, draws = lift_draws(traced.partitioned.forward)
    assert not _draws_of(forward)
    assert draws is not None and all(isinstance(d, Draw) for d in draws.descriptors)
    ops = {d.op for d in draws.descriptors}
    expected_ops = {"aten.bernoulli.p", "aotgrad.fill_random.default", "aten.rand.default"}
    assert expected_ops | {"aten.native_dropout.default", "aten.randperm.default"} <= ops
    placeholders = list(forward.graph.find_nodes(op="placeholder"))
    assert [n.meta["desc"] for n in placeholders[-len(draws.descriptors) :]] == list(
        draws.descriptors
    )
    torch.manual_seed(5)
    expected = _many_draws(x, w)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    got = forward(x, w, *draws())[0]
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("options", [dict(decompositions="core_aten"), dict(random="inputs")])
def test_aot_function_with_draws_as_inputs_equals_eager(options):
    """Each call draws anew, as eager: three calls, three masks, every gradient equal, and
    with Core ATen every op of both graphs the compiler receives is Core ATen."""
    x, w = _inputs()
    recorder = Recorder()
    compiled = aotgrad.aot_function(_many_draws, fw_compiler=recorder, **options)
    for seed in range(3):
        want, want_grads, after = _eager_step(_many_draws, (x, w), seed)
        got, got_grads, got_after = _eager_step(compiled, (x, w), seed)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for g, e in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        assert torch.equal(got_after, after)
    forward, backward = recorder.graphs
    assert not _draws_of(forward) and not _draws_of(backward)
    if "decompositions" in options:
        assert not non_core_nodes(forward.graph) and not non_core_nodes(backward.graph)


def test_random_ops_kept_by_default_without_core_aten():
    """Without a named set, the compiler receives the random ops (random='ops'), as before."""
    recorder = Recorder()
    aotgrad.aot_function(lambda x: F.dropout(x, 0.5), fw_compiler=recorder)(
        torch.ones(8, requires_grad=True)
    )
    assert _draws_of(recorder.graphs[0])


def test_option_values_are_checked():
    with pytest.raises(ConfigError, match="random='draws' is not a choice"):
        aotgrad.aot_function(torch.sin, random="draws")
    traced = aotgrad.trace(lambda x: F.dropout(x, 0.5), torch.ones(4, requires_grad=True))
    with pytest.raises(ConfigError, match=r"export\(random='yes'\)"):
        traced.export(random="yes")


def _probabilities(x):
    return torch.bernoulli(x.softmax(-1)) * x  # draws from values the graph computes


def _multinomial(x):
    return x.gather(-1, torch.multinomial(x.softmax(-1), 2))


def _rrelu(x):
    return F.rrelu(x, training=True)  # draws only where x < 0


def _own_generator(x):
    return x * torch.rand(x.shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (_probabilities, "aten.bernoulli.default"),
        (_multinomial, "aten.multinomial.default"),
        (_rrelu, "rrelu_with_noise"),
    ],
)
def test_draws_reading_computed_values_are_refused(fn, op):
    """Such a draw cannot be made before the graph runs: refused at capture, naming the op and
    the user's line; the random ops kept (random='ops') still run as eager."""
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(UnsupportedOpError, match=rf"(?s){op}.*depend on values.*test_random_draws"):
        aotgrad.aot_function(fn, decompositions="core_aten")(x)
    with pytest.raises(UnsupportedOpError, match=rf"(?s){op}.*depend on values"):
        aotgrad.trace(fn, x).export(flat=True)
    torch.manual_seed(0)
    expected = fn(x)
    torch.manual_seed(0)
    torch.testing.assert_close(aotgrad.aot_function(fn)(x), expected)


def test_draws_of_symbolic_size_are_refused():
    f = aotgrad.aot_function(lambda x: F.dropout(x, 0.5), random="inputs", dynamic=True)
    with pytest.raises(UnsupportedOpError, match="symbolic size"):
        f(torch.ones(4, 3, requires_grad=True))


def test_reseed_inside_the_function_moves_to_the_draw_program(tmp_path):
    def f(x):
        torch.manual_seed(7)
        return F.dropout(x, 0.5) + torch.rand_like(x)

    x = torch.ones(16, requires_grad=True)
    programs = aotgrad.trace(f, x).export(flat=True, decompositions="core_aten")
    assert not _draws_of(programs.forward.module())
    torch.manual_seed(0)
    expected, after = f(x), torch.get_rng_state()
    torch.manual_seed(1)  # another stream before: the reseed decides
    (got, *_) = programs.forward.module()(x, *programs.draw())
    assert torch.equal(got, expected) and torch.equal(torch.get_rng_state(), after)


def test_checkpointed_dropout_backward_reads_the_forward_draw():
    """A checkpoint's recompute reuses the forward's mask, as eager's checkpoint restores the
    generator: the exported backward takes no draw, and the step equals eager's."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def f(x):
        return torch.utils.checkpoint.checkpoint(
            lambda h: F.dropout(lin(h).relu(), 0.5), x, use_reentrant=False
        ).sum()

    x = torch.randn(4, 8, requires_grad=True)
    programs = aotgrad.trace(f, x).export(flat=True, decompositions="core_aten")
    assert len(programs.draws.graph_signature.user_outputs) == 1
    torch.manual_seed(3)
    loss = f(x)
    loss.backward()
    torch.manual_seed(3)
    result = step(programs, _run_torch)(x)
    torch.testing.assert_close(result.outputs[0], loss.detach())
    grads = {str(d): g for d, g in result.grads.items()}
    torch.testing.assert_close(grads["x"], x.grad)
    torch.testing.assert_close(grads["closure lin.weight"], lin.weight.grad)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_flat_programs_with_dropout_run_in_a_backend(backend):
    """The dropout convnet: dropout2d, dropout and stochastic depth, Core ATen, one step in a
    backend equal to eager's under the same seed."""
    torch.manual_seed(0)
    tv = pytest.importorskip("library_models").import_torchvision()
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.Dropout2d(0.2),
        torch.nn.ReLU(),
        tv.ops.StochasticDepth(0.3, "row"),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.4),
        torch.nn.Linear(8 * 8 * 8, 4),
    )
    images = torch.randn(4, 3, 8, 8)
    torch.manual_seed(11)
    programs, _ = check_backend(
        model, lambda y: y.square().mean(), (images,), {}, _compile(backend), 1e-4, 1e-5
    )
    assert not any(is_random(n.target) for n in programs.forward.graph.nodes)
    assert sum(isinstance(d, Draw) for d in programs.forward_inputs) == 3


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "tv_vit"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_library_models_with_dropout_run_in_a_backend(name, backend):
    """GPT-2 with dropout 0.1, BERT with dropout, timm's ViT with drop path and attention
    dropout, torchvision's ViT: one step of the Core ATen flat programs equals eager's."""
    library_models = pytest.importorskip("library_models")
    case = library_models.build(name, 0.1)
    args, kwargs = case.inputs
    torch.manual_seed(1234)
    programs, _ = check_backend(
        case.model, case.loss, args, kwargs, _compile(backend), rtol=1e-4, atol=1e-5
    )
    assert any(isinstance(d, Draw) for d in programs.forward_inputs)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_three_sgd_steps_of_gpt2_with_dropout_in_a_backend(backend):
    """The programs compiled once, run for three SGD steps, each drawing anew: the parameters
    stay eager's."""
    library_models = pytest.importorskip("library_models")
    case = library_models.build("gpt2", 0.1)
    args, kwargs = case.inputs
    eager, ported = copy.deepcopy(case.model), copy.deepcopy(case.model)
    traced = aotgrad.trace(
        lambda *a, **k: case.loss(ported(*a, **k)), *args, decompositions="core_aten", **kwargs
    )
    programs = traced.export(flat=True)
    run = step(programs, _compile(backend))
    tensors = [
        t
        for i, t in enumerate(torch.utils._pytree.tree_leaves((args, kwargs)))
        if i in traced.partitioned.joint.inputs.tensor_positions
    ]
    params = dict(ported.named_parameters())
    lifted = {
        str(d): t
        for d, t in zip(
            programs.forward_inputs[: len(programs.lifted)], programs.lifted, strict=True
        )
    }
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for seed in range(3):
        torch.manual_seed(seed)
        optimizer.zero_grad()
        case.loss(eager(*args, **kwargs)).backward()
        optimizer.step()
        torch.manual_seed(seed)
        result = run(*tensors)
        with torch.no_grad():
            for desc, grad in result.grads.items():
                lifted[str(desc)].sub_(0.1 * grad)  # the program's parameters, in place
    for name, param in eager.named_parameters():
        torch.testing.assert_close(params[name], param, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_scan_layers_with_dropout_exports_per_iteration_draws(backend):
    """The notebook's case with dropout: one GPT-2 block with attention and residual dropout,
    captured once by scan_layers in Core ATen, exported, and run by a backend in a loop over
    the layers, drawing each iteration's masks before its forward: equal to eager's loop."""
    from test_backend_scan import _named_extras
    from test_scan_layers import _decoder_stack, _through

    layers, hidden, args, kwargs, _ = _decoder_stack("gpt2")
    layers.train()
    for module in layers.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    eager_layers = copy.deepcopy(layers)
    options = dict(layer_kwargs=kwargs, decompositions="core_aten")
    body = aotgrad.scan_layers_function(layers, *args, **options)
    torch.manual_seed(0)
    aotgrad.scan_layers(layers, hidden.clone().requires_grad_(), *args, **options).sum().backward()
    programs = body.traced.export(flat=True)
    draws = [d for d in programs.forward_inputs if isinstance(d, Draw)]
    assert len(draws) >= 3  # attention, attention output, MLP output dropout
    compile_program = _compile(backend)
    if isinstance(compile_program, str):
        compile_program = __import__(BACKENDS[backend], fromlist=["x"]).compile_program
    forward, backward = compile_program(programs.forward), compile_program(programs.backward)
    extras = _named_extras(args, kwargs)
    inputs = []  # per position: "carry", a parameter's name, or an extra tensor
    for desc in map(str, programs.forward_inputs[: -len(draws)]):
        which, name = ("", desc) if desc == "carry" else (desc[2], desc[6:-2])
        inputs.append(extras[name] if which == "1" else name)
    torch.manual_seed(9)
    with torch.no_grad():
        carry, saved = hidden, []
        for layer in layers:
            params = dict(layer.named_parameters())
            row = [
                carry if i == "carry" else params[i] if isinstance(i, str) else i for i in inputs
            ]
            carry, *values = forward(*row, *programs.draw())
            saved.append(values)
        grad, grads = torch.ones_like(carry), []
        for values in reversed(saved):
            grad, *rest = backward(*values, grad)
            grads.append(rest)
        grads.reverse()
    after = torch.get_rng_state()
    x = hidden.clone().requires_grad_()
    torch.manual_seed(9)
    expected = _through(eager_layers, x, args, kwargs)
    assert torch.equal(torch.get_rng_state(), after)
    expected.sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.manual_seed(9)  # aotgrad's own loop, drawing before each compiled forward
    scanned = aotgrad.scan_layers(layers, hidden.clone().requires_grad_(), *args, **options)
    torch.testing.assert_close(scanned, expected, **tol)
    torch.testing.assert_close(carry, expected.detach(), **tol)
    torch.testing.assert_close(grad, x.grad, **tol)
    grads_of = [str(g.of) for g in programs.backward_outputs][1:]
    for layer, layer_grads in zip(eager_layers, grads, strict=True):
        got = dict(zip(grads_of, layer_grads, strict=True))
        for name, param in layer.named_parameters():
            torch.testing.assert_close(got[f"x[0]['{name}']"], param.grad, msg=name, **tol)


_DRAWS = {
    "dropout": lambda h, p: F.dropout(h, p),
    "dropout_t": lambda h, p: F.dropout(h.t(), p).t(),
    "native": lambda h, p: torch.native_dropout(h, p, True)[0],
    "alpha": lambda h, p: F.alpha_dropout(h, p, True),
    "rand_mask": lambda h, p: h * (torch.rand_like(h) > p),
    "drop_path": lambda h, p: h * h.new_empty(h.shape[0], 1).bernoulli_(1 - p),
    "noise": lambda h, p: h + p * torch.randn(h.shape[-1]),
}


@settings(max_examples=25, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(_DRAWS)), min_size=1, max_size=4),
    p=st.sampled_from([0.1, 0.5, 0.9]),
    rows=st.integers(1, 5),
    cols=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_draws_as_inputs_against_eager(names, p, rows, cols, seed):
    """Random chains of draws, shapes and seeds: Core ATen graphs with draws as inputs give
    eager's values, gradients and final generator state."""

    def f(x):
        h = x
        for name in names:
            h = _DRAWS[name](h.sin(), p)
        return h

    torch.manual_seed(0)
    x = torch.randn(rows, cols, requires_grad=True)
    want, (want_grad,), after = _eager_step(f, (x,), seed)
    compiled = aotgrad.aot_function(f, decompositions="core_aten", disk_cache=False)
    got, (got_grad,), got_after = _eager_step(compiled, (x,), seed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_after, after)


def _dropout_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 6)
    )


GLOBAL_MODEL = _dropout_mlp()


def _global_loss(x):
    return GLOBAL_MODEL(x).square().sum()


def _idiom(name, model, x):
    """``model``'s loss on ``x`` through one of the ways users call aotgrad, Core ATen."""
    core = dict(decompositions="core_aten")
    if name == "aot_module":
        compiled = aotgrad.aot_module(model, **core)
        return lambda x: compiled(x).square().sum()
    if name == "trace":
        traced = aotgrad.trace(model, x, **core)
        return lambda x: traced(x).square().sum()
    if name == "dynamo":
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aotgrad.dynamo.backend(**core))
        return lambda x: compiled(x).square().sum()
    assert name == "global"
    return aotgrad.aot_function(_global_loss, **core)


@pytest.mark.parametrize("idiom", ["aot_module", "trace", "dynamo", "global"])
def test_every_frontend_draws_eager_masks_in_core_aten(idiom):
    """aot_module, trace then call, torch.compile and a loss over a global model, Core ATen:
    each of two calls equals eager's step under its seed (values, every gradient, the input's,
    and the generator after), and a create_graph double backward too."""
    x = torch.randn(5, 4, requires_grad=True)
    model = GLOBAL_MODEL if idiom == "global" else _dropout_mlp()
    eager = copy.deepcopy(model)
    loss = _idiom(idiom, model, x)
    for seed in range(2):
        results = []
        for mod, f in ((eager, lambda x: eager(x).square().sum()), (model, loss)):
            mod.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            value = f(x)
            (gx,) = torch.autograd.grad(value, x, create_graph=True)
            gx.square().sum().backward()
            grads = [p.grad for p in mod.parameters()]
            results.append((value.detach(), gx.detach(), grads, torch.get_rng_state()))
        (v0, g0, p0, s0), (v1, g1, p1, s1) = results
        torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
        for a, b in zip(p1, p0, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert torch.equal(s1, s0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_joint_program_takes_the_draws_after_the_cotangents(backend):
    """The flat joint program, (*lifted, x, cotangent, *draws) -> (loss, *grads), compiled by a
    backend, with the draws the forward takes: equal to eager's step."""
    model = _dropout_mlp()
    x = torch.randn(5, 4)
    programs = aotgrad.trace(lambda x: model(x).square().sum(), x).export(flat=True, joint=True)
    compile_program = _compile(backend)
    if isinstance(compile_program, str):
        compile_program = __import__(BACKENDS[backend], fromlist=["x"]).compile_program
    joint = compile_program(programs.joint)
    torch.manual_seed(6)
    loss, *grads = joint(*programs.lifted, x, torch.ones(()), *programs.draw())
    torch.manual_seed(6)
    expected = model(x).square().sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-5)
    names = [str(d.of) for d in programs.joint_outputs[1:]]
    assert names == [f"closure model.{n}" for n, _ in model.named_parameters()]
    for grad, param in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(grad, param.grad, rtol=1e-4, atol=1e-5)
