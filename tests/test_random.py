"""Random ops draw exactly what eager draws at the same seed, whatever the layout they fill."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.utils.checkpoint import checkpoint

import aotgrad
from aotgrad.testing import verify

# Layouts of the tensor a random op fills: eager's kernels draw in memory order.
LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x.t(),
    "expanded": lambda x: x[:1].expand(x.shape[0], x.shape[1]),
    "strided gaps": lambda x: x[:, ::2],
    "transposed gaps": lambda x: x.t()[::2],
}

OPS = {
    "dropout": lambda y: F.dropout(y, 0.5),
    "alpha_dropout": lambda y: F.alpha_dropout(y, 0.3, True),
    "rand_like": lambda y: torch.rand_like(y) * y,
    "randn_like": lambda y: torch.randn_like(y) + y,
    "bernoulli_ float": lambda y: y.clone().bernoulli_(0.3) * y,
    "normal_": lambda y: y * 1 + torch.empty_like(y).normal_(),
    "uniform_ of a view": lambda y: (y * 1).t().uniform_(-1, 1),
    "exponential_": lambda y: y * torch.empty_like(y).exponential_(),
    "two draws in order": lambda y: F.dropout(y, 0.5) + torch.rand_like(y),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(OPS))
def test_random_op_draws_as_eager_on_layout(op, layout):
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    verify(lambda x: OPS[op](LAYOUTS[layout](x)), x)


def test_dropout_on_channels_last_draws_as_eager():
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_()
    verify(lambda x: F.dropout(x, 0.5), x)


def test_in_place_fill_of_a_transposed_input_view():
    verify(lambda x: x.t().bernoulli_(0.4) * 1, torch.zeros(5, 6))


def test_dropout_of_transposed_under_checkpoint_draws_once():
    def f(x):
        return checkpoint(lambda y: F.dropout(y.t(), 0.5).sin(), x, use_reentrant=False)

    verify(f, torch.randn(4, 6, requires_grad=True))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.native_dropout(x, 0.5, True)[0],
        lambda x: F.dropout(x.t(), 0.5),
        lambda x: torch.native_dropout(x, 0.5, False)[0] * 2,
    ],
    ids=["native_dropout", "dropout of transposed", "native_dropout in eval"],
)
def test_decompositions_keep_eager_draws(fn):
    # torch's native_dropout decomposition draws uniforms where eager draws Bernoullis.
    aten = torch.ops.aten
    table = {**core_aten_decompositions(), **get_decompositions([aten.native_dropout])}
    compile_fn = functools.partial(aotgrad.aot_function, decompositions=table)
    verify(fn, torch.randn(4, 6, requires_grad=True), compile_fn=compile_fn)


def test_multihead_attention_batch_first_with_dropout():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 5, 8, requires_grad=True)
    verify(lambda x: mha(x, x, x)[0], x)


def test_transformer_encoder_layer_with_dropout():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True).train()
    verify(layer, torch.randn(2, 5, 8, requires_grad=True))


def test_torchvision_vit_with_dropout():
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(
        image_size=8,
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
        dropout=0.2,
        attention_dropout=0.3,
        num_classes=3,
    ).train()
    verify(model, torch.randn(2, 3, 8, 8), rtol=1e-4, atol=1e-5)


# Note [Reseeding inside the function]


def _reseeded(x, seed=0):
    torch.manual_seed(seed)
    return F.dropout(x, 0.5) * torch.rand(x.shape) + torch.randn(x.shape)


def _run_as_eager(fn, compiled, *args, calls=3):
    """Each call from a different caller's stream: values, grads and the stream after it."""
    for call in range(calls):
        outcomes = []
        for f in (fn, compiled):
            torch.manual_seed(1000 + call)  # the same caller's stream for both
            x = torch.randn(4, 6, requires_grad=True)
            torch.manual_seed(77 * call)  # a different state before each call: reseeded inside
            out = f(x, *args)
            (grad,) = torch.autograd.grad(out.square().sum(), x)
            outcomes.append((out, grad, torch.get_rng_state(), torch.rand(3)))
        torch.testing.assert_close(outcomes[1][:2], outcomes[0][:2])
        assert torch.equal(outcomes[1][2], outcomes[0][2]), "the generator state after the call"
        assert torch.equal(outcomes[1][3], outcomes[0][3]), "the draws after the call"


@pytest.mark.parametrize("tracer", ["auto", "full"])
def test_a_reseed_before_every_random_op_runs_at_every_call(tracer):
    _run_as_eager(_reseeded, aotgrad.aot_function(_reseeded, tracer=tracer))


def test_the_reseed_is_an_op_of_the_forward_graph():
    traced = aotgrad.trace(_reseeded, torch.ones(2, 3))
    code = traced.forward.code
    assert "torch.ops.aotgrad.manual_seed.default(0, 'default')" in code
    assert code.index("manual_seed") < code.index("bernoulli")


@pytest.mark.parametrize("seeds", [(3, 3, 4, 3), (0, 2**64 - 1, 2**63, -5)])
def test_a_seed_passed_as_a_python_argument_is_part_of_the_key(seeds):
    compiled = aotgrad.aot_function(_reseeded)
    for seed in seeds:
        _run_as_eager(_reseeded, compiled, seed, calls=1)


SEED = 11


def _reseeded_from_a_global(x):
    torch.manual_seed(SEED)
    return F.dropout(x, 0.5)


def test_a_seed_read_from_a_global_is_part_of_the_key():
    global SEED
    compiled = aotgrad.aot_function(_reseeded_from_a_global)
    for value in (11, 12, 11):
        SEED = value
        _run_as_eager(_reseeded_from_a_global, compiled, calls=1)


def test_a_reseed_with_no_random_op_leaves_the_generator_as_eager():
    def f(x):
        torch.manual_seed(5)
        return x * 2

    _run_as_eager(f, aotgrad.aot_function(f))


def test_a_module_that_reseeds_in_forward():
    class Seeded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x):
            torch.random.manual_seed(123)
            return self.drop(self.lin(x))

    model = Seeded()
    compiled = aotgrad.aot_module(model)
    _run_as_eager(model, compiled)


def test_cuda_manual_seed_is_replayed_too():
    def f(x):
        torch.cuda.manual_seed(4)  # CPU draws are not changed by it, in eager as compiled
        torch.cuda.manual_seed_all(4)
        torch.manual_seed(4)
        return F.dropout(x, 0.5)

    _run_as_eager(f, aotgrad.aot_function(f))


def test_reseeding_after_a_random_op_is_refused_before_the_generator_changes():
    def f(x):
        y = F.dropout(x, 0.5)
        torch.manual_seed(0)  # the line the error names
        return F.dropout(y, 0.5)

    state = torch.get_rng_state()
    seeders = (torch.manual_seed, torch.random.manual_seed, torch.cuda.manual_seed)
    with pytest.raises(aotgrad.errors.UnsupportedOpError, match="after 1 random op") as caught:
        aotgrad.aot_function(f)(torch.ones(8))
    assert "torch.manual_seed(0)  # the line the error names" in str(caught.value)
    assert torch.equal(torch.get_rng_state(), state)
    restored = (torch.manual_seed, torch.random.manual_seed, torch.cuda.manual_seed)
    assert all(a is b for a, b in zip(restored, seeders, strict=True))  # after the capture
    torch.manual_seed(0)  # and works again


def test_reseeding_inside_a_checkpointed_region_is_refused():
    def region(x):
        torch.manual_seed(0)
        return F.dropout(x, 0.5).sin()

    def f(x):
        return checkpoint(region, x, use_reentrant=False)

    with pytest.raises(aotgrad.errors.UnsupportedOpError, match="checkpointed region"):
        aotgrad.aot_function(f)(torch.ones(8, requires_grad=True))


@pytest.mark.parametrize("seed", ["torch", "torch.random", "torch.cuda"])
def test_a_fresh_seed_is_refused(seed):
    owner = {"torch": torch, "torch.random": torch.random, "torch.cuda": torch.cuda}[seed]

    def f(x):
        owner.seed()
        return F.dropout(x, 0.5)

    with pytest.raises(aotgrad.errors.UnsupportedOpError, match="non-deterministic seed"):
        aotgrad.aot_function(f)(torch.ones(8))


def test_reseeding_inside_fork_rng_is_refused():
    def f(x):
        with torch.random.fork_rng():  # eager: the caller's stream comes back at the exit
            torch.manual_seed(0)
            y = F.dropout(x, 0.5)
        return y

    with pytest.raises(aotgrad.errors.UnsupportedOpError, match="fork_rng"):
        aotgrad.aot_function(f)(torch.ones(8))


def test_another_thread_seeding_during_a_capture_seeds_as_eager():
    import threading

    seeded = []

    def other_thread():
        seeded.append(torch.seed())  # not the traced function: must work as in eager
        torch.manual_seed(3)
        seeded.append(torch.rand(2))

    def f(x):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        return x * 2

    aotgrad.aot_function(f)(torch.ones(2))
    assert len(seeded) == 2 and isinstance(seeded[0], int)
    torch.manual_seed(3)
    assert torch.equal(seeded[1], torch.rand(2))


def test_a_reseed_the_trace_cannot_see_is_refused():
    """Note [Reseeds the trace cannot see]: a generator's own manual_seed (not replaceable)
    would run once, at capture; eager reseeds on every call."""

    def direct(x):
        torch.default_generator.manual_seed(0)
        return F.dropout(x, 0.5)

    outside = torch.get_rng_state()

    def restores_a_foreign_state(x):
        torch.default_generator.set_state(outside)
        return F.dropout(x, 0.5)

    for fn in (direct, restores_a_foreign_state):
        with pytest.raises(aotgrad.errors.UnsupportedOpError, match="reseeded torch's default"):
            aotgrad.aot_function(fn)(torch.ones(8))


def test_the_traces_own_stream_steps_are_not_reseeds():
    """Dropout twice, a checkpointed dropout (its recompute restores the generator state)
    and torch.manual_seed before the random ops: all captured, eager's numbers."""

    def f(x):
        torch.manual_seed(5)
        y = F.dropout(x, 0.5)
        y = checkpoint(lambda t: F.dropout(t.sin(), 0.3), y, use_reentrant=False)
        return F.dropout(y, 0.2)

    x = torch.ones(16, requires_grad=True)
    compiled = aotgrad.aot_function(f)
    for _ in range(2):
        assert torch.equal(compiled(x), f(x))


def test_the_stand_ins_and_the_generator_restore_each_do_their_own_job():
    """``rng_stand_ins`` replaces torch's RNG functions while it is in (outside a trace they
    call torch's own) and puts them back; ``generator_restored`` puts the generator's state
    back and refuses a reseed it did not make (Note [Reseeds the trace cannot see])."""
    from aotgrad.capture.tracing.rng import generator_restored, rng_stand_ins

    originals = (torch.manual_seed, torch.get_rng_state, torch.set_rng_state, torch.seed)
    with rng_stand_ins():
        assert torch.manual_seed is not originals[0]
        torch.manual_seed(7)  # no trace runs: torch's own, as in eager
        assert torch.default_generator.initial_seed() == 7
    assert (torch.manual_seed, torch.get_rng_state, torch.set_rng_state, torch.seed) == originals
    before = torch.get_rng_state()
    with generator_restored():
        torch.rand(3)  # steps the generator, as a trace's random ops do
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(aotgrad.errors.UnsupportedOpError, match="reseeded"), generator_restored():
        torch.default_generator.manual_seed(0)
    assert torch.equal(torch.get_rng_state(), before)
