"""DDP and FSDP2 through aot_module, trace and torch.compile(backend="aotgrad"), on 2 gloo ranks:
3 SGD steps equal 3 eager steps on every rank (Note [Wrappers run around the graphs]).

Each test is one spawn (tests/multiproc.py) that trains the same model every way and returns
what each way saw; the comparisons run in the parent.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aotgrad
from multiproc import run_ranks

WAYS = ("eager", "aot_module", "trace", "compile")
TIMEOUT = 150.0


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "ddp":
        return DDP(model)
    if kind == "ddp_static":
        return DDP(model, static_graph=True)
    if kind == "ddp_find_unused":
        return DDP(model, find_unused_parameters=True)
    if kind == "ddp_inside":
        return nn.Sequential(DDP(model))
    if kind == "fsdp_grouped":
        fully_shard([model[0], model[2]])
        return fully_shard(model)
    if kind == "fsdp_bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fully_shard(model[0], mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if kind == "fsdp_not_root":
        fully_shard(model[2])
        return model
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def _full(t: torch.Tensor | None) -> list[Any] | None:
    """A parameter or gradient as one plain tensor (FSDP2's are DTensors), as a list: tensors
    crossing the process boundary would need their rank alive to be read."""
    if t is None:
        return None
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().tolist()


def _runner(way: str, model: nn.Module, example: torch.Tensor) -> Any:
    if way == "aot_module":
        return aotgrad.aot_module(model)
    if way == "trace":
        return aotgrad.trace(model, example)
    if way == "compile":
        return torch.compile(model, backend="aotgrad")
    return model


def train(kind: str, way: str, steps: int = 3) -> dict[str, Any]:
    """``steps`` SGD steps of the wrapped MLP on this rank's data: losses, then the last
    step's gradients and the parameters after it, as full tensors by name."""
    model = _wrap(kind, _mlp())
    torch.manual_seed(1 + dist.get_rank())  # different data on each rank: DDP must average
    xs = [torch.randn(4, 8) for _ in range(steps)]
    run = _runner(way, model, xs[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], {}
    for x in xs:
        loss = run(x).pow(2).sum()
        loss.backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: _full(p) for n, p in model.named_parameters()}
    # aot_module traces once: the wrapper's bookkeeping is neither an input nor guarded.
    misses = run.compiled.info.misses if way == "aot_module" else None
    # The graphs' inputs: the captured module's parameters, by the wrapper's names, as plain
    # tensors (FSDP2's unsharded ones); reports work on every rank.
    graph = None
    if way == "trace":
        placeholders = [n for n in run.forward.graph.nodes if n.op == "placeholder"]
        graph = {
            "inputs": [str(d) for d in run.signature.forward_inputs],
            "types": sorted({type(n.meta["val"]).__name__ for n in placeholders}),
            "report": run.memory_report(),
            "seq_table": str(run.seq_table()),
        }
    return {"losses": losses, "grads": grads, "params": params, "misses": misses, "graph": graph}


def every_way(kind: str) -> dict[str, dict[str, Any]]:
    """One rank's training, every way (one spawn for all of them)."""
    return {way: train(kind, way) for way in WAYS}


def _assert_same_as_eager(ranks: list[dict[str, dict[str, Any]]]) -> None:
    for rank, ways in enumerate(ranks):
        eager = ways["eager"]
        assert ways["aot_module"]["misses"] == 1, f"rank {rank}: aot_module traced again"
        for way in WAYS[1:]:
            got = ways[way]
            where = f"rank {rank}, {way}"
            torch.testing.assert_close(got["losses"], eager["losses"], msg=where)
            assert got["grads"].keys() == eager["grads"].keys(), where
            for name, g in eager["grads"].items():
                assert g is not None, f"{where}: no grad of {name}"
                _close(got["grads"][name], g, f"{where}: grad of {name}")
                _close(got["params"][name], eager["params"][name], f"{where}: {name}")
    # Synchronized: the ranks saw different data and still hold the same parameters.
    assert ranks[0]["eager"]["losses"] != ranks[1]["eager"]["losses"]
    for name, p in ranks[0]["eager"]["params"].items():
        _close(ranks[1]["eager"]["params"][name], p, f"eager {name} on both ranks")


def _close(got: Any, expected: Any, where: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), msg=where)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_three_sgd_steps_equal_eager_on_every_rank(kind):
    ranks = run_ranks(every_way, kind, timeout=TIMEOUT)
    _assert_same_as_eager(ranks)
    prefix = "module." if kind == "ddp" else ""
    for ways in ranks:
        graph = ways["trace"]["graph"]
        assert graph["inputs"][:2] == [f"param {prefix}0.weight", f"param {prefix}0.bias"]
        assert graph["inputs"][-1] == "input" and len(graph["inputs"]) == 7
        assert graph["types"] == ["FakeTensor"]  # plain tensors only, no DTensor
        assert f"|{prefix}4" in graph["seq_table"] and "total:" in graph["report"]


def test_the_documented_script_is_the_example():
    """docs/distributed.md shows examples/distributed.py as it is."""
    root = Path(__file__).resolve().parents[1]
    script = (root / "examples" / "distributed.py").read_text()
    assert f"```python\n{script}```" in (root / "docs" / "distributed.md").read_text()


# What each refused configuration's error must say: the configuration, and what to do.
REFUSED = {
    "ddp_find_unused": ["find_unused_parameters=True", "find_unused_parameters=False"],
    "ddp_inside": ["DDP module at 0", "aotgrad.aot_module(DDP(model))"],
    "fsdp_grouped": ["module '0'", "grouped fully_shard", "Call fully_shard on each module"],
    "fsdp_bf16": ["param_dtype=torch.bfloat16", "Leave param_dtype and output_dtype unset"],
    "fsdp_not_root": ["fully_shard module at 2", "fully_shard(model)"],
    "ddp_read_by_function": ["closure ddp holds a DDP module", "aot_module(DDP(model))"],
}


def refusals_and_what_works() -> dict[str, Any]:
    """Every refused configuration's error, by frontend, and its training eagerly and through
    torch.compile (which the errors recommend); DDP(static_graph=True) and DDP's no_sync()
    through aot_module and eagerly (one spawn for all of it)."""
    errors: dict[str, list[str]] = {}
    x = torch.ones(4, 8)
    for kind in REFUSED:
        for frontend in (lambda m: aotgrad.aot_module(m)(x), lambda m: aotgrad.trace(m, x)):
            try:
                frontend(_wrapped_or_read(kind))
                errors.setdefault(kind, []).append("no error")
            except aotgrad.UnsupportedWrapperError as e:
                errors.setdefault(kind, []).append(str(e))
    compiled = {
        kind: {way: train(kind, way)["losses"] for way in ("eager", "compile")}
        for kind in ("ddp_find_unused", "fsdp_grouped", "fsdp_bf16")
    }
    static = {way: train("ddp_static", way) for way in ("eager", "aot_module")}
    no_sync = {way: accumulate_without_sync(way) for way in ("eager", "aot_module")}
    return {"errors": errors, "compiled": compiled, "static": static, "no_sync": no_sync}


def _wrapped_or_read(kind: str) -> Any:
    """The wrapped model, or for "ddp_read_by_function" a module whose forward reads a DDP."""
    if kind != "ddp_read_by_function":
        return _wrap(kind, _mlp())
    ddp = _wrap("ddp", _mlp())

    class Reads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ddp(x)

    return Reads()


def accumulate_without_sync(way: str) -> list[Any]:
    """Two backwards under DDP's no_sync(), then one synchronized: the gradients after each."""
    model = _wrap("ddp", _mlp())
    torch.manual_seed(1 + dist.get_rank())
    xs = [torch.randn(4, 8) for _ in range(3)]
    run = _runner(way, model, xs[0])
    grads = []
    for i, x in enumerate(xs):
        with model.no_sync() if i < 2 else contextlib.nullcontext():
            run(x).pow(2).sum().backward()
        grads.append(_full(model.module[0].weight.grad))
    return grads


def test_refusals_say_what_to_do_and_what_works_equals_eager():
    """Note [Wrappers run around the graphs]: what aotgrad cannot run faithfully, it refuses."""
    ranks = run_ranks(refusals_and_what_works, timeout=TIMEOUT)
    for rank, result in enumerate(ranks):
        for kind, needles in REFUSED.items():
            for message in result["errors"][kind]:
                for needle in [*needles, 'torch.compile(model, backend="aotgrad")']:
                    assert needle in message, f"{kind}: {needle!r} not in {message!r}"
        for kind, ways in result["compiled"].items():
            _close(ways["compile"], ways["eager"], f"rank {rank}: {kind} through torch.compile")
        static = result["static"]
        _close(static["aot_module"]["losses"], static["eager"]["losses"], "static_graph")
        for name, p in static["eager"]["params"].items():
            _close(static["aot_module"]["params"][name], p, f"rank {rank}: static_graph {name}")
        no_sync = result["no_sync"]
        _close(no_sync["aot_module"], no_sync["eager"], f"rank {rank}: no_sync grads")
    # Under no_sync the ranks' gradients differ; the synchronized backward makes them equal.
    assert ranks[0]["no_sync"]["eager"][0] != ranks[1]["no_sync"]["eager"][0]
    _close(ranks[0]["no_sync"]["eager"][2], ranks[1]["no_sync"]["eager"][2], "synchronized")


def test_the_example_training_script_runs_as_documented():
    """examples/distributed.py (docs/distributed.md): 2 processes, aotgrad equals eager (its FSDP2
    part; DDP's is the same code path, trained above)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "distributed.py"
    done = subprocess.run(
        [sys.executable, str(script), "fsdp"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Two processes print to one pipe: their lines may run together, so match anywhere.
    ranks = sorted(re.findall(r"rank (\d) fsdp: losses \[[^\]]*\] as eager", done.stdout))
    assert ranks == ["0", "1"], done.stdout


# --- Note [All-gathers in flight together] ---------------------------------------------------


def _fsdp_mlp(reshard_after_forward: bool = True) -> nn.Module:
    """Two outputs, three fully_shard units and the root: a model the prefetch has work in."""
    from torch.distributed.fsdp import fully_shard

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(
                *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
            )
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.layers(x)
            return self.head(h), h.sum(dim=1)

    model = Two()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    return fully_shard(model)


def _in_flight_at_waits(model: nn.Module) -> list[tuple[bool, int]]:
    """Record, at every wait for an all-gather, whether a backward runs it and how many of the
    model's parameter groups have an all-gather started and not yet copied out."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from aotgrad import _torch_compat as compat

    seen: list[tuple[bool, int]] = []
    real = FSDPParamGroup.wait_for_unshard

    def wait_for_unshard(group: Any) -> None:
        states = compat.fsdp_all_states(compat.fsdp_state(model))
        groups = [g for s in states for g in compat.fsdp_param_groups(s)]
        if group._all_gather_result is not None:
            pending = sum(g._all_gather_result is not None for g in groups)
            seen.append((torch._C._current_graph_task_id() != -1, pending))
        real(group)

    FSDPParamGroup.wait_for_unshard = wait_for_unshard  # type: ignore[method-assign]
    return seen


def prefetch_equals_eager(way: str) -> dict[str, Any]:
    """Three SGD steps of ``_fsdp_mlp`` (eager or aot_module), in the ways the all-gather
    prefetch must not change: a loss of both outputs or of one, a second backward through a
    retained graph (gradients accumulate), an evaluation under no_grad between steps, units
    that keep their parameters after the forward. Also the all-gathers in flight at each wait."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    real_wait = FSDPParamGroup.wait_for_unshard
    found: dict[str, Any] = {}
    for keep in (False, True):
        model = _fsdp_mlp(reshard_after_forward=not keep)
        seen = _in_flight_at_waits(model)
        run = aotgrad.aot_module(model) if way == "aot_module" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1 + dist.get_rank())
        losses: list[float] = []
        for step in range(3):
            x = torch.randn(4, 8)
            out, side = run(x)
            loss = out.pow(2).sum() + (side.sum() if step != 1 else 0)
            loss.backward(retain_graph=step == 2)
            if step == 2:
                loss.backward()  # through the retained graph: gathers again, grads add up
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                losses.append(float(run(x)[0].sum()) + loss.item())
        FSDPParamGroup.wait_for_unshard = real_wait  # type: ignore[method-assign]
        found[f"keep={keep}"] = {
            "losses": losses,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "in_flight": [
                max((n for b, n in seen if b == backward), default=0) for backward in (False, True)
            ],
        }
    return found


def prefetch_every_way() -> dict[str, dict[str, Any]]:
    return {way: prefetch_equals_eager(way) for way in ("eager", "aot_module")}


def test_all_gathers_start_together_and_train_as_eager():
    """Note [All-gathers in flight together]: aotgrad starts every unit's all-gather before
    waiting for the first (eager FSDP2 on gloo waits for each before starting the next), and
    trains exactly as eager FSDP2 does."""
    ranks = run_ranks(prefetch_every_way, timeout=TIMEOUT)
    for rank, ways in enumerate(ranks):
        for case, eager in ways["eager"].items():
            got = ways["aot_module"][case]
            where = f"rank {rank}, {case}"
            torch.testing.assert_close(got["losses"], eager["losses"], msg=where)
            for name, p in eager["params"].items():
                _close(got["params"][name], p, f"{where}: {name}")
            assert eager["in_flight"] == [1, 1], where
        # The root's and the three units' all-gathers in flight together, in the forward
        # and in the backward (also where units keep their parameters after the forward: the
        # second backward through the retained graph follows a reshard of all of them).
        for case in ("keep=False", "keep=True"):
            assert ways["aot_module"][case]["in_flight"] == [4, 4], (rank, case)
