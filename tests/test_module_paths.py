"""Module paths however the function reaches the module (Note [Module paths as the signature
names them]): every report names ``net.0``, not ``Linear``, and the name is the signature's.

Each way a user reaches a model -- a global, a closure cell, an argument, ``self.model`` of a
plain trainer object (a bound method), an attribute of a global object, a default argument,
the module itself -- is checked in every report: the seq table, the saved values and the peak
(``memory_report``), the HTML report's document, ``aotgrad.profile``, and ``node.meta``; and
the compiled function against eager (output and every parameter's ``.grad``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.capture import Kind, node_info
from aotgrad.report.html import report_document

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
alias = net  # the same module under a second global


def by_global(x):
    return net(x).square().mean()


def closing_over(model):
    def by_closure(x):
        return model(x).square().mean()

    return by_closure


def by_argument(model, x):
    return model(x).square().mean()


class Trainer:
    """A plain object holding the model, as training loops write it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def step(self, x):
        return self.model(x).square().mean()


holder = Trainer(net)


def by_attribute(x):
    return holder.model(x).square().mean()


def by_default(x, model=net):
    return model(x).square().mean()


def by_two_names(x):
    return alias(x).square().mean() + net[0](x).sum()


@dataclass(frozen=True)
class Way:
    """A way of reaching ``net``: the function, its arguments, and the path it gives ``net``."""

    fn: Callable[..., Any]
    args: Callable[[torch.Tensor], tuple[Any, ...]]
    prefix: str  # ``net``'s path: its children are ``{prefix}.0``, ...; "" for the module itself
    root: str  # the name of the function's own ops


WAYS = {
    "global": Way(by_global, lambda x: (x,), "net", "by_global"),
    "closure": Way(closing_over(net), lambda x: (x,), "model", "by_closure"),
    "argument": Way(by_argument, lambda x: (net, x), "model", "by_argument"),
    "bound method": Way(holder.step, lambda x: (x,), "self.model", "step"),
    "global object": Way(by_attribute, lambda x: (x,), "holder.model", "by_attribute"),
    "default": Way(by_default, lambda x: (x,), "model (default)", "by_default"),
    "two names": Way(by_two_names, lambda x: (x,), "alias", "by_two_names"),
    "module": Way(net, lambda x: (x,), "", "Sequential"),
}


def child(way: Way, i: int) -> str:
    return f"{way.prefix}.{i}" if way.prefix else str(i)


def example() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 4)


@pytest.fixture(params=list(WAYS), name="way")
def _way(request) -> Way:
    return WAYS[request.param]


def test_the_seq_table_names_each_layer_by_its_path(way):
    traced = aotgrad.trace(way.fn, *way.args(example()))
    modules = {row.module for row in traced.seq_table() if row.kind != Kind.ACCUMULATE.value}
    assert modules == {child(way, 0), child(way, 1), child(way, 2), way.root} - {"Sequential"}
    relu = [r for r in traced.seq_table() if r.op.startswith("aten.relu")]
    assert [r.module for r in relu] == [child(way, 1)]


def test_the_path_is_the_one_the_signature_gives_the_parameters(way):
    """``grad of global net.0.weight`` and the ops of ``net.0`` agree, in ``node.meta`` too:
    each lifted parameter's placeholder, and every forward op reading it, belong to its module."""
    traced = aotgrad.trace(way.fn, *way.args(example()))
    placeholders = [n for n in traced.forward.graph.nodes if n.op == "placeholder"]
    lifted = dict(zip(placeholders, traced.signature.forward_inputs, strict=False))
    owners = {}
    for node, descriptor in lifted.items():
        name = getattr(descriptor, "name", None) or getattr(descriptor, "path", "")
        if name.endswith((".weight", ".bias")):
            owners[node] = name.rpartition(".")[0]
    assert sorted(set(owners.values())) == [child(way, 0), child(way, 2)]
    for node, owner in owners.items():
        assert node_info(node).module == owner, node.name
        for user in node.users:
            if user.op == "call_function":
                assert node_info(user).module == owner, (node.name, user.name)
    grads = [str(d) for d in traced.signature.backward_outputs if d is not None]
    assert any(g.endswith(f"{child(way, 0)}.weight") for g in grads), grads


def test_memory_report_html_and_profile_name_the_paths(way):
    args = way.args(example())
    traced = aotgrad.trace(way.fn, *args)
    saved = {s.module for s in traced.saved}
    assert child(way, 1) in saved  # relu's output, read by threshold_backward
    assert not saved & {"Linear", "ReLU"}
    peak = traced.partitioned.peak
    live = {v.module for v in peak.live}
    assert child(way, 0) in live | {peak.module}  # net.0's weight is an input held live
    assert not (live | {peak.module}) & {"Linear", "ReLU"}
    text = traced.memory_report(by_module=True)
    assert f"[{child(way, 1)}]" in text and not re.search(r"\b(Linear|ReLU)\b", text)
    document = report_document(traced.partitioned)
    drawn = {
        n.get("module") for phase in ("forward", "backward") for n in document["graphs"][phase]
    }
    assert {child(way, 0), child(way, 1), child(way, 2)} <= drawn
    assert not drawn & {"Linear", "ReLU"}
    report = aotgrad.profile(way.fn, *args, repeats=1)
    assert {child(way, 0), child(way, 1), child(way, 2)} <= set(report.modules)
    assert report.modules[child(way, 0)].backward_ops > 0


def test_compiled_function_matches_eager_and_names_the_paths(way):
    x = example()
    model = net
    net.zero_grad(set_to_none=True)
    expected = way.fn(*way.args(x))
    expected.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    net.zero_grad(set_to_none=True)
    compiled = (
        aotgrad.aot_module(way.fn)
        if isinstance(way.fn, nn.Module)
        else aotgrad.aot_function(way.fn)
    )
    out = compiled(*way.args(x))
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)
    net.zero_grad(set_to_none=True)
    modules = {r.module for r in compiled.seq_table()}
    assert {child(way, 0), child(way, 1), child(way, 2)} <= modules


def test_a_module_reached_two_ways_has_the_signatures_one_name():
    """``alias`` and ``net`` are one module: its ops, called as ``alias`` or as ``net[0]``,
    take the name its parameters have in the signature."""
    traced = aotgrad.trace(by_two_names, example())
    names = {str(d) for d in traced.signature.forward_inputs}
    assert "global alias.0.weight" in names and not any("net." in n for n in names)
    linear = {r.module for r in traced.seq_table() if r.op.startswith("aten.addmm")}
    assert linear == {"alias.0", "alias.2"}


def test_a_module_made_inside_the_function_keeps_its_class_name():
    """Reached no way the walk reads: nothing names it better than its class."""

    def fresh(x):
        return nn.functional.relu(nn.Identity()(x)).sum()

    traced = aotgrad.trace(fresh, torch.randn(3, requires_grad=True))
    assert {r.module for r in traced.seq_table()} <= {"fresh", "Identity"}


# ---- Code we did not write: transformers' GPT-2, reached through a global ----

gpt2 = None


def gpt2_loss(ids):
    return gpt2(input_ids=ids, labels=ids).loss


@pytest.fixture(scope="module")
def gpt2_global():
    library_models = pytest.importorskip("library_models")
    pytest.importorskip("transformers")
    global gpt2
    gpt2 = library_models.gpt2().model  # 2 blocks, random config, nothing downloaded
    ids = torch.randint(0, library_models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    yield ids
    gpt2 = None


BLOCK_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "ln_1", "ln_2")


def test_hf_gpt2_through_a_global_has_per_block_paths_in_every_report(gpt2_global):
    ids = gpt2_global
    traced = aotgrad.trace(gpt2_loss, ids)
    table = {r.module for r in traced.seq_table()}
    expected = {f"gpt2.transformer.h.{b}.{m}" for b in (0, 1) for m in BLOCK_MODULES}
    assert expected <= table, sorted(table)
    assert not table & {"Conv1D", "GPT2Attention", "GPT2MLP", "LayerNorm"}
    saved = {s.module for s in traced.saved}
    assert {"gpt2.transformer.h.0.mlp.act", "gpt2.transformer.h.1.mlp.act"} <= saved
    document = report_document(traced.partitioned)
    drawn = {n.get("module") for n in document["graphs"]["backward"]}
    assert {f"gpt2.transformer.h.{b}.attn.c_attn" for b in (0, 1)} <= drawn
    report = aotgrad.profile(gpt2_loss, ids, repeats=1)
    assert {f"gpt2.transformer.h.{b}.mlp.c_fc" for b in (0, 1)} <= set(report.modules)


def test_hf_gpt2_through_a_global_matches_eager(gpt2_global):
    ids = gpt2_global
    reference = copy.deepcopy(gpt2)
    expected = reference(input_ids=ids, labels=ids).loss
    expected.sum().backward()
    gpt2.zero_grad(set_to_none=True)
    loss = aotgrad.aot_function(gpt2_loss)(ids)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), (_, q) in zip(
        gpt2.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    gpt2.zero_grad(set_to_none=True)
