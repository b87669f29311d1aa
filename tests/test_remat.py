"""Rematerialization: checkpoints honored on every path, min-cut, the exact budget solver."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from functorch.compile import min_cut_rematerialization_partition
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import aotgrad
from aotgrad.capture import Kind, node_info
from aotgrad.testing import verify
from models import GPT, ConvBN, DeepMLP
from reference import pytorch_stats


def stack(x, w):
    for _ in range(3):
        x = torch.sin(x @ w)
    return x


def checkpointed(use_reentrant):
    def f(x, w):
        return cp.checkpoint(stack, x, w, use_reentrant=use_reentrant)

    return f


def inputs():
    torch.manual_seed(0)
    return torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def activations(saved):
    return [s.name for s in saved if not s.is_input]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_saves_only_region_inputs_and_matches_eager(use_reentrant):
    fn = checkpointed(use_reentrant)
    traced = aotgrad.trace(fn, *inputs())
    assert activations(traced.saved) == []
    assert {s.name for s in traced.saved} == {"x", "w"}
    recomputed = [r for r in traced.partitioned.recomputed if "checkpoint" in r.reason]
    assert [r.op for r in recomputed].count("aten.mm.default") == 3  # the last sin is not needed
    verify(fn, *inputs())


@pytest.mark.parametrize("path", ["aot_function", "aot_module"])
def test_checkpoint_is_honored_on_every_path(path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return cp.checkpoint(stack, x, self.w, use_reentrant=False)

    x = torch.randn(8, 8, requires_grad=True)
    compiled = aotgrad.aot_module(Net()) if path == "aot_module" else aotgrad.aot_function(Net())
    compiled(x).sum().backward()
    partitioned = (compiled.compiled if path == "aot_module" else compiled).partitioned
    assert [s.name for s in partitioned.saved if not s.is_input] == []


def test_dropout_inside_a_checkpoint_reuses_the_forward_mask():
    def fn(x):
        return cp.checkpoint(lambda x: F.dropout(x.sin(), 0.5).cos(), x, use_reentrant=False)

    x = torch.randn(64, 64, requires_grad=True)
    torch.manual_seed(0)
    eager_x = x.detach().clone().requires_grad_()
    fn(eager_x).sum().backward()
    torch.manual_seed(0)
    ours_x = x.detach().clone().requires_grad_()
    aotgrad.aot_function(fn)(ours_x).sum().backward()
    torch.testing.assert_close(ours_x.grad, eager_x.grad, atol=1e-3, rtol=1e-3)
    traced = aotgrad.trace(fn, x)
    assert "bernoulli" in [s.name for s in traced.saved]  # the mask is saved, not redrawn
    ops = [str(n.target) for n in traced.backward.graph.nodes if n.op == "call_function"]
    assert not any("bernoulli" in op for op in ops)


def test_selective_checkpoint_saves_what_the_policy_says():
    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x, w):
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return cp.checkpoint(stack, x, w, use_reentrant=False, context_fn=context)

    traced = aotgrad.trace(fn, *inputs())
    producers = {s.producer for s in traced.saved if not s.is_input}
    assert producers == {"aten.mm.default"}
    verify(fn, *inputs())


def test_nested_checkpoints():
    def inner(x, w):
        return cp.checkpoint(stack, x, w, use_reentrant=False)

    def fn(x, w):
        return cp.checkpoint(lambda x, w: inner(x, w).cos(), x, w, use_reentrant=False)

    traced = aotgrad.trace(fn, *inputs())
    assert activations(traced.saved) == []
    verify(fn, *inputs())


def test_checkpoint_plan_equals_the_bytes_autograd_holds():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            y = cp.checkpoint(stack, x, self.w, use_reentrant=False)
            return (y @ self.w).relu().sum()

    compiled = aotgrad.aot_module(Net())
    x = torch.randn(32, 64, requires_grad=True)
    compiled(x)  # trace first
    held = {}

    def pack(t):
        held[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x)
    loss.backward()
    assert sum(held.values()) == compiled.compiled.partitioned.saved_bytes


PARTITIONS = ["save_all", "mincut", aotgrad.budget(0.5), aotgrad.budget(0.1)]


@pytest.mark.parametrize("partition", PARTITIONS, ids=str)
def test_partitions_keep_eager_gradients(partition):
    torch.manual_seed(0)
    model, idx = GPT(blocks=2), torch.randint(0, 64, (2, 16))
    compile_fn = functools.partial(aotgrad.aot_module, partition=partition)
    verify(model, idx, idx, compile_fn=compile_fn, atol=1e-4, rtol=1e-4)


def test_mincut_recomputes_cheap_pointwise_chains_only():
    torch.manual_seed(0)
    model, idx = GPT(blocks=2), torch.randint(0, 64, (2, 16))
    full = aotgrad.trace(model, idx, idx).partitioned
    cut = aotgrad.trace(model, idx, idx, partition="mincut").partitioned
    assert cut.saved_bytes < full.saved_bytes
    for op in cut.recomputed:
        assert not any(k in op.op for k in ("mm", "convolution", "attention", "bernoulli", "sum"))
        assert op.reason.startswith(("min-cut", "free view", "graph constant"))


def test_budget_is_monotone_and_explains_itself():
    torch.manual_seed(0)
    model, idx = GPT(blocks=2), torch.randint(0, 64, (2, 16))
    results = [
        aotgrad.trace(model, idx, idx, partition=aotgrad.budget(b)).partitioned
        for b in (1.0, 0.7, 0.5, 0.3, 0.1)
    ]
    saved = [r.saved_bytes for r in results]
    flops = [r.recompute_flops for r in results]
    assert saved == sorted(saved, reverse=True), saved
    assert flops == sorted(flops), flops
    assert saved[-1] < saved[0] and flops[-1] > 0
    assert all(r.peak_bytes >= r.saved_bytes_beyond_inputs for r in results)
    assert all(
        op.reason.startswith(("budget", "free view", "graph constant"))
        for op in results[-1].recomputed
    )


def test_budget_in_bytes_caps_the_reported_saved_bytes():
    torch.manual_seed(0)
    model, x = DeepMLP(64, 3), torch.randn(4, 64)
    full = aotgrad.trace(model, x).partitioned
    inputs = sum(s.nbytes for s in full.saved if s.is_input)
    for cap in (full.saved_bytes, inputs + 2048, (inputs + full.saved_bytes) // 2):
        plan = aotgrad.trace(model, x, partition=aotgrad.budget(cap)).partitioned
        assert plan.saved_bytes <= cap
        # the same cap as a byte count or as the fraction that gives it
        again = aotgrad.trace(model, x, partition=aotgrad.budget(plan.saved_bytes)).partitioned
        assert again.recompute_flops <= plan.recompute_flops
    with pytest.raises(ValueError, match=f"inputs the backward reads take {inputs}"):
        aotgrad.trace(model, x, partition=aotgrad.budget(inputs - 1))
    conv_args = (torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    conv_inputs = sum(s.nbytes for s in aotgrad.trace(ConvBN(), *conv_args).saved if s.is_input)
    with pytest.raises(ValueError, match="smallest plan saves"):
        aotgrad.trace(ConvBN(), *conv_args, partition=aotgrad.budget(conv_inputs + 1))


def test_every_budget_fraction_fits_a_training_batchnorm():
    # Note [Budget units]: a BatchNorm in training mode reads the running stats it updates, so
    # it is never recomputed; fractions start from the smallest plan, not from the inputs alone.
    torch.manual_seed(0)
    model, args = ConvBN(), (torch.randn(2, 1, 8, 8), torch.randn(2, 10))
    full = aotgrad.trace(model, *args).partitioned
    sizes = []
    for fraction in (0.01, 0.5, 1.0):
        compile_fn = functools.partial(aotgrad.aot_module, partition=aotgrad.budget(fraction))
        assert verify(model, *args, compile_fn=compile_fn).ok
        sizes.append(aotgrad.trace(model, *args, partition=aotgrad.budget(fraction)).partitioned)
    assert sizes[0].saved_bytes <= sizes[1].saved_bytes <= sizes[2].saved_bytes
    assert sizes[2].saved_bytes <= full.saved_bytes


def test_budget_fraction_interpolates_from_the_smallest_plan_to_save_all():
    torch.manual_seed(0)
    model, idx = GPT(blocks=2), torch.randint(0, 64, (2, 16))
    full = aotgrad.trace(model, idx, idx).partitioned
    inputs = sum(s.nbytes for s in full.saved if s.is_input)
    caps = [aotgrad.budget(f).bytes_for(full.joint) for f in (1e-9, 0.2, 0.5, 1.0)]
    assert inputs <= caps[0] < caps[1] < caps[2] < caps[3] == full.saved_bytes
    for fraction, cap in zip((0.2, 0.5, 1.0), caps[1:], strict=True):
        plan = aotgrad.trace(model, idx, idx, partition=aotgrad.budget(fraction)).partitioned
        assert plan.saved_bytes <= cap


def untied_gpt():
    torch.manual_seed(0)
    model = GPT(vocab=128, dim=64, heads=4, blocks=2, context=32, tied=False)
    idx = torch.randint(0, 128, (2, 32))
    return model, (idx, idx)


def test_mincut_saves_no_more_than_pytorchs_min_cut():
    model, args = untied_gpt()
    theirs, _ = pytorch_stats(model, args, min_cut_rematerialization_partition)
    ours = aotgrad.trace(model, *args, partition="mincut").partitioned
    assert ours.saved_bytes <= theirs


@pytest.mark.parametrize("fraction", [0.7, 0.5, 0.3])
def test_budget_at_pytorchs_bytes_dominates_its_knapsack(fraction):
    # Note [Budget units]: a byte count caps saved_bytes, so handing aotgrad the
    # bytes PyTorch's plan saved poses the same problem; the exact solver must
    # then recompute no more, and (FLOPs tied) save no more.
    model, args = untied_gpt()
    saved, flops = pytorch_stats(model, args, min_cut_rematerialization_partition, fraction)
    ours = aotgrad.trace(model, *args, partition=aotgrad.budget(saved)).partitioned
    assert ours.saved_bytes <= saved and ours.recompute_flops <= flops


def test_attention_without_dropout_may_be_recomputed():
    model, args = untied_gpt()
    tight = aotgrad.trace(model, *args, partition=aotgrad.budget(0.05)).partitioned
    assert any("attention" in op.op for op in tight.recomputed)
    verify(
        model,
        *args,
        compile_fn=functools.partial(aotgrad.aot_module, partition=aotgrad.budget(0.05)),
        atol=1e-4,
        rtol=1e-4,
    )


def test_budget_time_limit_is_reported():
    torch.manual_seed(0)
    model, idx = GPT(blocks=2), torch.randint(0, 64, (2, 16))
    plan = aotgrad.trace(
        model, idx, idx, partition=aotgrad.budget(0.3, time_limit=1e-6)
    ).partitioned
    assert plan.note is not None and "time limit" in plan.note


def test_recomputed_ops_carry_their_forward_seq_nr():
    traced = aotgrad.trace(checkpointed(False), *inputs())
    forward = {node_info(n).seq_nr for n in traced.forward.graph.nodes if n.op == "call_function"}
    for n in traced.backward.graph.nodes:
        if n.op == "call_function" and node_info(n).kind is Kind.RECOMPUTE:
            assert node_info(n).seq_nr in forward


def test_user_partition_policy():
    seen = []

    def mine(node):
        seen.append(str(node.target))
        return False

    aotgrad.trace(lambda x: x.sin().cos().sum(), torch.randn(3, requires_grad=True), partition=mine)
    assert seen == ["aten.sin.default", "aten.cos.default", "aten.sum.default"]
