"""DTensor inputs and tensor parallelism (``parallelize_module``) on 2 gloo ranks, against eager
(Note [Tensor subclasses]). Each test spawns the ranks once and runs all its checks there;
results cross the process boundary as Python lists, never as tensors."""

from __future__ import annotations

import json
import operator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aotgrad
import aotgrad._torch_compat as compat
from aotgrad.report import show_document
from multiproc import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

TIMEOUT = 150.0


def _mesh() -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", [0, 1])


def _dtensor_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu()


def _graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [str(n.target) for n in calls if n.target is not operator.getitem]


def _plain_only(gm: torch.fx.GraphModule) -> bool:
    from torch.distributed.tensor import DTensor

    return not any(isinstance(n.meta.get("val"), DTensor) for n in gm.graph.nodes)


def _dtensor_checks() -> dict[str, Any]:
    """A function of DTensors: values, gradients and placements against eager; the graphs."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = _mesh()
    torch.manual_seed(0)
    x_full, w_full = torch.randn(4, 6), torch.randn(6, 4)

    def inputs(x_placement: Any) -> tuple[DTensor, DTensor]:
        x = distribute_tensor(x_full, mesh, [x_placement]).requires_grad_()
        w = distribute_tensor(w_full, mesh, [Shard(1)]).requires_grad_()
        return x, w

    compiled = aotgrad.aot_function(_dtensor_fn)
    out: dict[str, Any] = {"runs": []}
    for placement in (Shard(0), Shard(0), Replicate()):
        x, w = inputs(placement)
        xe, we = inputs(placement)
        y, ye = compiled(x, w), _dtensor_fn(xe, we)
        y.full_tensor().sum().backward()
        ye.full_tensor().sum().backward()
        out["runs"].append(
            {
                "type": type(y).__name__,
                "placements": [str(y.placements), str(ye.placements)],
                "value": torch.equal(y.full_tensor(), ye.full_tensor()),
                "grad types": [type(x.grad).__name__, type(w.grad).__name__],
                "x grad placements": [str(x.grad.placements), str(xe.grad.placements)],
                "w grad placements": [str(w.grad.placements), str(we.grad.placements)],
                "grads": torch.allclose(x.grad.full_tensor(), xe.grad.full_tensor())
                and torch.allclose(w.grad.full_tensor(), we.grad.full_tensor()),
            }
        )
    out["misses"] = compiled.info.misses
    traced = aotgrad.trace(_dtensor_fn, *inputs(Shard(0)))
    out["inputs"] = [str(d) for d in traced.signature.forward_inputs]
    out["grads"] = [str(g) for g in traced.signature.backward_outputs]
    out["plain"] = all(_plain_only(gm) for gm in (traced.joint, traced.forward, traced.backward))
    out["forward ops"] = _graph_ops(traced.forward)
    out["backward ops"] = _graph_ops(traced.backward)
    return out


@pytest.mark.skipif(
    compat.TORCH_RELEASE < (2, 12),
    reason="torch 2.11's DTensor backward returns a gradient whose inner tensors differ from the"
    " input's layout; aotgrad refuses it (UnsupportedSubclassError), loudly",
)
def test_dtensor_function_matches_eager_with_plain_graphs_and_collectives():
    ranks = run_ranks(_dtensor_checks, timeout=TIMEOUT)
    for result in ranks:
        for run in result["runs"]:
            assert run["type"] == "DTensor"
            assert run["placements"][0] == run["placements"][1], run
            assert run["value"] and run["grads"], run
            assert run["grad types"] == ["DTensor", "DTensor"]
            assert run["x grad placements"][0] == run["x grad placements"][1], run
            # Eager leaves w's gradient Partial, with a local shape that is not w's local
            # shape; the backward graph returns one gradient per inner tensor, of its shape,
            # so it reduce-scatters to w's own placement (Note [Tensor subclasses]).
            assert run["w grad placements"][0] == "(Shard(dim=1),)", run
            assert run["w grad placements"][1] in ("(Shard(dim=1),)", "(Partial(sum),)"), run
        # The second Shard(0) call hits; Replicate is another placement: another trace.
        assert result["misses"] == 2
        assert result["inputs"] == ["x._local_tensor", "w._local_tensor"]
        assert result["grads"] == ["grad of x._local_tensor", "grad of w._local_tensor"]
        assert result["plain"]
        # x Shard(0) @ w Shard(1): DTensor gathers w in the forward; the backward gathers
        # again and reduce-scatters w's gradient.
        assert "aten.mm.default" in result["forward ops"]
        assert "_c10d_functional.all_gather_into_tensor.default" in result["forward ops"]
        assert "_c10d_functional.reduce_scatter_tensor.default" in result["backward ops"]
        assert all(
            op.startswith(("aten.", "_c10d_functional.")) for op in result["backward ops"]
        ), result
    assert ranks[0]["backward ops"] == ranks[1]["backward ops"]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())


class Attention(nn.Module):
    """Causal self-attention; each rank holds half the heads of q, k, v (local head count)."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def _tp_model(kind: str) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    if kind == "mlp":
        return parallelize_module(
            MLP(), _mesh(), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
    return parallelize_module(Attention(), _mesh(), {**plan, "o": RowwiseParallel()})


def _batches(kind: str) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the same batch on both ranks: TP replicates the input
    return [torch.randn(4, 8) if kind == "mlp" else torch.randn(2, 5, 16) for _ in range(3)]


def _train(frontend: str, kind: str = "mlp") -> dict[str, Any]:
    """Three SGD steps of a TP model through ``frontend``: losses, grads, parameters."""
    model = _tp_model(kind)
    batches = _batches(kind)
    if frontend == "aot_module":
        run: Any = aotgrad.aot_module(model)
    elif frontend == "trace":
        run = aotgrad.trace(model, batches[0])
    elif frontend == "torch.compile":
        torch._dynamo.reset()
        run = torch.compile(model, backend="aotgrad")
    else:
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for x in batches:
        loss = run(x).pow(2).sum()
        loss.backward()
        grads.append(
            [
                (n, str(p.grad.placements), p.grad.full_tensor().tolist())
                for n, p in model.named_parameters()
            ]
        )
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [(n, str(p.placements), p.full_tensor().tolist()) for n, p in model.named_parameters()]
    out = {"losses": losses, "grads": grads, "params": params}
    if frontend == "aot_module" and kind == "mlp":
        out["reports"] = _reports(run)
    return out


def _reports(run: Any) -> dict[str, Any]:
    partitioned = run.compiled.partitioned
    document = show_document(partitioned)
    json.dumps(document)  # the saved report is JSON-ready
    return {
        "seq ops": [row.op for row in run.seq_table()],
        "memory": run.memory_report(),
        "saved": [s["name"] for s in document["saved"]],
        "inputs": [str(d) for d in partitioned.signature.forward_inputs],
    }


def _tp_checks() -> dict[str, Any]:
    mlp = {f: _train(f) for f in ("eager", "aot_module", "trace", "torch.compile")}
    attention = {f: _train(f, "attention") for f in ("eager", "aot_module", "torch.compile")}
    return {"mlp": mlp, "attention": attention}


def _close(a: Any, b: Any) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def _check_like_eager(results: dict[str, Any], frontends: tuple[str, ...]) -> None:
    eager = results["eager"]
    for frontend in frontends:
        got = results[frontend]
        assert _close(got["losses"], eager["losses"]), (frontend, got["losses"])
        for step, (grads, grads_e) in enumerate(zip(got["grads"], eager["grads"], strict=True)):
            for (name, placement, g), (_, placement_e, g_e) in zip(grads, grads_e, strict=True):
                assert placement == placement_e, (frontend, step, name)
                assert _close(g, g_e), (frontend, step, name)
        for (name, placement, p), (_, placement_e, p_e) in zip(
            got["params"], eager["params"], strict=True
        ):
            assert placement == placement_e and _close(p, p_e), (frontend, name)


def test_tensor_parallel_mlp_and_attention_train_like_eager_through_every_frontend():
    ranks = run_ranks(_tp_checks, timeout=TIMEOUT)
    for result in ranks:
        _check_like_eager(result["mlp"], ("aot_module", "trace", "torch.compile"))
        _check_like_eager(result["attention"], ("aot_module", "torch.compile"))
        reports = result["mlp"]["aot_module"]["reports"]
        assert reports["inputs"][:2] == [
            "param fc1.weight._local_tensor",
            "param fc1.bias._local_tensor",
        ]
        assert "aten.mm.default" in reports["seq ops"] or "aten.addmm.default" in reports["seq ops"]
        # RowwiseParallel sums the partial products of the ranks: an all_reduce in the forward.
        assert any(op.startswith("_c10d_functional.all_reduce") for op in reports["seq ops"])
        assert reports["saved"] and "total" in reports["memory"].lower()
    assert ranks[0]["mlp"]["eager"]["losses"] == ranks[1]["mlp"]["eager"]["losses"]
