"""Functional collectives in the graphs, on 2 gloo ranks (Note [Collectives]).

Each spawn costs seconds, so each rank function runs many checks and returns what the test
asserts on: values and gradients against eager, the collectives of the graphs, errors' texts.
"""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import aotgrad
from aotgrad.capture import Phase, node_info
from aotgrad.capture.analyses import collectives as collectives_module
from aotgrad.capture.analyses.collectives import (
    COLLECTIVE_KEY,
    CollectiveCheckWarning,
    collective_calls,
)
from aotgrad.errors import CollectiveGradError, CollectiveMismatchError, UnsupportedOpError
from multiproc import run_ranks

TIMEOUT = 120


def world():
    return dist.group.WORLD


# --- functions with collectives ------------------------------------------------------------------


def all_reduce_fn(x, w):
    return fc.all_reduce(x @ w, "sum", world()).sin()


def all_gather_fn(x, w):
    return fc.all_gather_tensor(x @ w, 1, world()).sin()  # gather_dim 1: a split and a cat


def reduce_scatter_fn(x, w):
    return fc.reduce_scatter_tensor(x @ w, "sum", 0, world()).sin()


def autograd_op_fn(x, w):  # the _c10d_functional_autograd op, as older code calls it
    gathered = torch.ops._c10d_functional_autograd.all_gather_into_tensor(
        x @ w, 2, world().group_name
    )
    return fc.wait_tensor(gathered).sin()


def chain_fn(x, w):  # pointwise ops on both sides of the collective: tempting to recompute
    y = fc.all_reduce((x @ w).sin(), "sum", world())
    return (y.sin() * 2).sin().cos()


def _region(x, w):
    return fc.all_reduce((x @ w).sin(), "sum", world()).cos()


def checkpointed_fn(x, w):
    return checkpoint(_region, x, w, use_reentrant=False).sum(0)


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def selective_fn(x, w):
    contexts = lambda: create_selective_checkpoint_contexts(_recompute_everything)  # noqa: E731
    return checkpoint(_region, x, w, use_reentrant=False, context_fn=contexts).sum(0)


def broadcast_fn(x, w):  # no gradient formula in torch
    return fc.broadcast(x @ w, 0, world()).sin()


def broadcast_detached_fn(x, w):
    return fc.broadcast((x @ w).detach(), 0, world()).sin() * w.sum()


def tensor_parallel_mlp(x, w1, w2):  # w1 column-sharded, w2 row-sharded across the ranks
    return fc.all_reduce((x @ w1).relu() @ w2, "sum", world())


FUNCTIONS = [
    all_reduce_fn,
    all_gather_fn,
    reduce_scatter_fn,
    autograd_op_fn,
    chain_fn,
    checkpointed_fn,
    selective_fn,
    broadcast_detached_fn,
]
PARTITIONS = {"save_all": "save_all", "mincut": "mincut", "budget": aotgrad.budget(0.01)}


def _inputs():
    torch.manual_seed(dist.get_rank())  # different data per rank: collectives matter
    return torch.randn(4, 3), torch.randn(3, 4, requires_grad=True)


def _eager(fn, x, w):
    out = fn(x, w)
    (grad,) = torch.autograd.grad(out.sum(), w)
    return out.detach(), grad


def _collectives(gm):
    """The graph's collectives as every rank must agree on them, with the graph they are in."""
    return [str(call) for call in collective_calls(gm.graph)]


# --- rank functions ----------------------------------------------------------------------------


def values_and_graphs():
    """Every function x tracer x partition against eager; the graphs' collectives."""
    x, w = _inputs()
    result = {"mismatches": [], "order": {}, "recomputed_collectives": [], "backward": {}}
    result["direct_differs"] = []
    for fn in FUNCTIONS:
        want_out, want_grad = _eager(fn, x, w)
        # The two tracers give one graph; the direct trace refuses a selective checkpoint
        # (Note [Selective checkpoints stop the direct trace]).
        tracers = ("full",) if fn is selective_fn else ("direct", "full")
        if len(tracers) == 2:
            direct, full = (aotgrad.trace(fn, x, w, tracer=t) for t in tracers)
            if direct.joint.code != full.joint.code:
                result["direct_differs"].append(fn.__name__)
        for tracer in tracers:
            for label, partition in PARTITIONS.items():
                compiled = aotgrad.aot_function(fn, tracer=tracer, partition=partition)
                out = compiled(x, w)
                (grad,) = torch.autograd.grad(out.sum(), w)
                if not (torch.allclose(out, want_out) and torch.allclose(grad, want_grad)):
                    result["mismatches"].append((fn.__name__, tracer, label))
        for label, partition in PARTITIONS.items():
            traced = aotgrad.trace(fn, x, w, partition=partition)
            forward, backward = _collectives(traced.forward), _collectives(traced.backward)
            result["order"][(fn.__name__, label)] = (forward, backward)
            result["backward"][(fn.__name__, label)] = [
                node_info(n).phase.value
                for n in traced.backward.graph.nodes
                if COLLECTIVE_KEY in n.meta
            ]
            result["recomputed_collectives"] += [
                r.op for r in traced.partitioned.recomputed if "c10d" in r.op
            ]
    return result


def training_and_reports():
    """3 SGD steps of a tensor-parallel MLP, eager and through aotgrad; reports; the ban."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    full1, full2 = torch.randn(8, 16), torch.randn(16, 4)
    shards = (full1[:, rank * 8 : rank * 8 + 8], full2[rank * 8 : rank * 8 + 8])
    result = {}
    for label, partition in PARTITIONS.items():
        runs = {}
        for how in ("eager", "aot"):
            w1, w2 = (s.clone().requires_grad_() for s in shards)
            fn = tensor_parallel_mlp
            if how == "aot":
                fn = aotgrad.aot_function(tensor_parallel_mlp, partition=partition)
            opt = torch.optim.SGD([w1, w2], lr=0.01)
            torch.manual_seed(1)  # the same batch on both ranks, as tensor parallelism wants
            losses = []
            for _ in range(3):
                loss = fn(torch.randn(4, 8), w1, w2).pow(2).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs[how] = (losses, w1.tolist(), w2.tolist())  # plain lists: tensors pickle badly
        result[label] = runs
    x, w = _inputs()
    traced = aotgrad.trace(chain_fn, x, w)
    result["seq_table"] = str(traced.seq_table())
    result["memory_report"] = traced.memory_report()
    result["saved_producers"] = [s.producer for s in traced.saved]
    # Without the ban, a budget recomputes the collective and the order check catches it.
    with mock.patch("aotgrad.partition.remat.is_collective", lambda op: False):
        try:
            aotgrad.trace(chain_fn, x, w, partition=PARTITIONS["budget"])
            result["unbanned"] = "no error"
        except AssertionError as e:
            result["unbanned"] = str(e)
    result["dynamo"] = compiled_by_dynamo()
    return result


_GROUPS = {}


def _mismatched_group(x):
    group = world() if dist.get_rank() == 0 else _GROUPS["other"]  # rank 1 alone uses it
    return fc.all_reduce(x, "sum", group).sin()


def _rank_dependent(x):
    y = fc.all_reduce(x, "sum", world())
    if dist.get_rank() == 1:
        y = fc.all_reduce(y, "max", world())
    return y


def _only_rank_0(x):
    return fc.all_reduce(x, "sum", world())


def _in_place(x):
    y = x * 2
    dist.all_reduce(y)
    return y


def errors():
    """The errors: a gradient through broadcast, groups and sequences that differ per rank."""
    x, w = _inputs()
    _GROUPS["other"] = dist.new_group([0, 1])  # the same ranks as WORLD, another group
    result = {}
    for name, call in {
        "broadcast_grad": lambda: aotgrad.trace(broadcast_fn, x, w),
        "group": lambda: aotgrad.trace(_mismatched_group, x),
        "sequence": lambda: aotgrad.trace(_rank_dependent, x),
        "in_place": lambda: aotgrad.aot_function(_in_place)(x),
    }.items():
        try:
            call()
            result[name] = "no error"
        except (CollectiveGradError, CollectiveMismatchError, UnsupportedOpError) as e:
            result[name] = f"{type(e).__name__}: {e}"
    with mock.patch.object(collectives_module, "CHECK_TIMEOUT_S", 0):  # the check turned off
        result["check_off"] = str(aotgrad.trace(_mismatched_group, x).tracer)
    # The check waits a bounded time for a rank that does not capture, then warns.
    with (
        mock.patch.object(collectives_module, "CHECK_TIMEOUT_S", 1.0),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        if dist.get_rank() == 0:
            aotgrad.trace(_only_rank_0, x)
    result["timeout"] = [str(c.message) for c in caught if c.category is CollectiveCheckWarning]
    return result


def compiled_by_dynamo():
    x, w = _inputs()
    want_out, want_grad = _eager(all_reduce_fn, x, w)
    compiled = torch.compile(all_reduce_fn, backend="aotgrad", fullgraph=True)
    out = compiled(x, w)
    (grad,) = torch.autograd.grad(out.sum(), w)
    return torch.allclose(out, want_out), torch.allclose(grad, want_grad)


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.fast_path  # compares the direct trace with the full one
def test_values_grads_and_the_order_of_collectives_equal_on_both_ranks():
    rank0, rank1 = run_ranks(values_and_graphs, timeout=TIMEOUT)
    for result in (rank0, rank1):
        assert result["mismatches"] == []
        assert result["direct_differs"] == []
        assert result["recomputed_collectives"] == []
        # The backward's collectives are the gradients' (Note [Collectives], rule 1).
        for (fn, label), phases in result["backward"].items():
            want = [] if fn == "broadcast_detached_fn" else [Phase.BACKWARD.value]
            assert sorted(set(phases)) == want, (fn, label, phases)
    assert rank0["order"] == rank1["order"]
    forward, backward = rank0["order"][("all_reduce_fn", "mincut")]
    assert forward == ["all_reduce(sum) over group '0' (ranks 0, 1) of float32[4, 4]"]
    assert backward == forward
    # A checkpointed region's all_reduce is not run again in the backward: one forward,
    # one gradient all_reduce, under every partition and a recompute-everything policy.
    for fn in ("checkpointed_fn", "selective_fn"):
        for label in ("save_all", "mincut"):
            forward, backward = rank0["order"][(fn, label)]
            assert (len(forward), len(backward)) == (1, 1), (fn, label)
    forward, backward = rank0["order"][("reduce_scatter_fn", "save_all")]
    assert forward[0].startswith("reduce_scatter_tensor(sum)")
    assert backward[0].startswith("all_gather_into_tensor over group '0'")


def test_training_reports_and_the_recompute_ban():
    rank0, rank1 = run_ranks(training_and_reports, timeout=TIMEOUT)
    for rank, result in enumerate((rank0, rank1)):
        for label in PARTITIONS:
            eager, aot = result[label]["eager"], result[label]["aot"]
            assert eager[0] == aot[0] or torch.allclose(
                torch.tensor(eager[0]), torch.tensor(aot[0])
            )
            for a, b in zip(eager[1:], aot[1:], strict=True):
                assert torch.allclose(torch.tensor(a), torch.tensor(b)), (rank, label)
        assert (
            "_c10d_functional.all_reduce.default [sum over group '0', ranks 0, 1]"
            in result["seq_table"]
        )
        assert "wait_tensor.default [of all_reduce sum over group '0'" in result["memory_report"]
        assert any("of all_reduce sum" in p for p in result["saved_producers"])
        assert "aotgrad bug" in result["unbanned"] and "Note [Collectives]" in result["unbanned"]
        assert result["dynamo"] == (True, True)  # torch.compile(backend="aotgrad")
    # The ranks' losses differ from each other's (each rank's shard), and equal eager's.
    assert rank0["mincut"]["aot"][0] == rank1["mincut"]["aot"][0]  # all_reduce: same output


@pytest.mark.fast_path  # compares the direct trace with the full one
def test_errors_name_the_collective_and_the_groups():
    rank0, rank1 = run_ranks(errors, timeout=TIMEOUT)
    for result in (rank0, rank1):
        assert result["broadcast_grad"].startswith("CollectiveGradError: a gradient flows through")
        assert "broadcast" in result["broadcast_grad"]
        assert result["group"].startswith("CollectiveMismatchError")
        assert "group '0'" in result["group"] and "group '1'" in result["group"]
        assert "all_reduce(sum)" in result["group"]
        assert "collective #2 is" in result["sequence"]
        assert result["check_off"] == "direct"  # captured: nothing compared
        assert result["in_place"].startswith("UnsupportedOpError: c10d.allreduce_.default is one")
        assert "_functional_collectives.all_reduce(t, 'sum', group) instead" in result["in_place"]
    assert "collective #2 is none on rank 0 but all_reduce(max)" in rank0["sequence"]
    assert "rank 1 captured no such function" in rank0["timeout"][0]
    assert rank1["timeout"] == []


_LIB = torch.library.Library("aotgrad_collectives_test", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")  # no autograd kernel
torch.library.register_fake("aotgrad_collectives_test::twice", lambda x: torch.empty_like(x))


def test_an_op_without_autograd_kernel_outside_torch_distributed_still_only_warns():
    """Only collectives' "no autograd kernel" warnings become errors (Note [Collectives])."""
    twice = torch.ops.aotgrad_collectives_test.twice
    x = torch.ones(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotgrad.trace(lambda x: twice(x.sin()), x)
    assert any("twice: an autograd kernel was not registered" in str(c.message) for c in caught)


def test_sends_and_receives_are_point_to_point():
    """(A test, not a doctest: torch 2.11 has no ``_c10d_functional.isend``.)"""
    from aotgrad.ops.table import is_point_to_point

    sends = [getattr(torch.ops._c10d_functional, name, None) for name in ("isend", "irecv")]
    for op in [s.default for s in sends if s is not None]:
        assert is_point_to_point(op)
    assert not is_point_to_point(torch.ops._c10d_functional.all_reduce.default)
    assert not is_point_to_point(torch.ops.aten.add.Tensor)
