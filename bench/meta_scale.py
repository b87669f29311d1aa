"""Llama-7B and Llama-70B shapes captured and planned on ``meta`` (issue 42, item 4).

The question a user asks before renting a machine: how much memory does one training step of
this model take on one GPU, at this batch and sequence length? aotgrad answers it from a model
built on the ``meta`` device (no parameter memory is ever allocated): the predicted peak of
``f(*inputs).backward()`` (Note [What a step holds] in ``src/aotgrad/partition/memory.py``),
under ``save_all``, ``mincut`` and a peak budget.

Each shape runs in a fresh process (``python bench/meta_scale.py --worker SHAPE BATCH SEQ``)
that reports, as one JSON line:

- capture: ``aotgrad.trace(loss, ids)`` with ``save_all`` (fake-tensor trace of forward and
  backward, the split, the default compiler), imports and the model's construction not in it;
- planning: ``aotgrad.partition.partition(joint, strategy)`` on the captured joint graph, per
  strategy (the same call ``trace(..., partition=strategy)`` makes after its capture);
- the process's peak resident memory (``getrusage``), against the bytes of the parameters it
  would have held on CPU;
- per strategy, the predicted peak (``Partitioned.peak``): bytes held at the step's peak, the
  inputs (parameters, ids) included, i.e. what one GPU holding the whole model needs for the
  forward and backward (no optimizer state, no CUDA context, no allocator rounding).

Attention: HF's ``sdpa`` calls ``F.scaled_dot_product_attention``, which picks its kernel by
device; on ``meta`` it takes the math path (B x H x S x S scores, saved for the backward),
where a CUDA GPU takes the flash kernel (a logsumexp per row). The model here therefore uses
``cuda_sdpa`` (:func:`cuda_sdpa_attention`): the op a CUDA step runs for HF's sdpa with no
padding mask, called directly (its meta kernel gives the shapes). ``--attention sdpa`` measures
the meta device's own choice instead.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import os
import pstats
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Llama-2 7B and 70B (hidden, intermediate, layers, heads, kv heads, vocab).
SHAPES: dict[str, dict[str, int]] = {
    "llama7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "llama70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
}
# The (batch, sequence) each shape is measured at by ``make bench``.
SIZES = {"llama7b": (1, 4096), "llama70b": (1, 2048)}
# The peak budgets: ``budget(peak=0)``, whose refusal names the family's floor (the least
# peak of any plan: what a user asks first), then halfway between that floor and mincut's
# predicted peak, planned afresh (the family forgotten in between).
FLOOR_TEXT = re.compile(r"smallest predicted peak of \d+ candidate plans is (\d+) bytes")


def cuda_sdpa_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """HF attention as a CUDA GPU runs its ``sdpa`` for a causal model without a padding mask:
    PyTorch's flash kernel, grouped key/value heads as they are (``enable_gqa``)."""
    import torch

    if attention_mask is not None:
        raise ValueError("cuda_sdpa_attention takes no padding mask (flash is causal-only here)")
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout, True, False, scale=scaling
    )[0]
    return out.transpose(1, 2).contiguous(), None


def build(shape: str, attention: str = "cuda_sdpa", layers: int | None = None) -> Any:
    """The transformers LlamaForCausalLM of ``shape`` in bf16 on ``meta``, in train mode."""
    sys.path.insert(0, str(ROOT / "tests"))
    importlib.import_module("library_models")  # the torchvision shim, before transformers
    import torch
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("cuda_sdpa", cuda_sdpa_attention)
    sizes = dict(SHAPES[shape])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    config = LlamaConfig(**sizes, attn_implementation=attention, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.train()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(
    shape: str,
    batch: int,
    seq: int,
    attention: str,
    layers: int | None,
    budget: bool = True,
    profile: bool = False,
) -> dict[str, Any]:
    """One fresh process: build, capture, plan; what it measured."""
    import torch

    import aotgrad

    rss_imports = _rss_mb()
    model = build(shape, attention, layers)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    start, cpu = time.perf_counter(), time.process_time()
    traced = aotgrad.trace(lambda ids: model(input_ids=ids, labels=ids).loss, ids)
    capture, capture_cpu = time.perf_counter() - start, time.process_time() - cpu
    rss_capture = _rss_mb()
    joint = traced.partitioned.joint
    plans = {"save_all": _plan_entry(traced.partitioned, capture, capture_cpu)}
    plans["mincut"] = _timed_plan(joint, "mincut")
    if budget:
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        plans["budget(peak=0)"] = _timed_plan(joint, aotgrad.budget(peak=0))
        floor = int(FLOOR_TEXT.search(plans["budget(peak=0)"]["refused"])[1])  # type: ignore[index]
        _forget_plans()
        limit = (floor + plans["mincut"]["allocated_bytes"]) // 2
        plans[f"budget(peak={limit / 1e9:.1f} GB)"] = _timed_plan(joint, aotgrad.budget(peak=limit))
        if profiler is not None:
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    return {
        "shape": shape,
        "layers": model.config.num_hidden_layers,
        "batch": batch,
        "seq": seq,
        "attention": attention,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "capture_s": capture,
        "capture_cpu_s": capture_cpu,  # this process's CPU time: the machine may be shared
        "nodes": len(joint.gm.graph.nodes),
        "rss_mb_imports": rss_imports,
        "rss_mb_capture": rss_capture,
        "rss_mb": _rss_mb(),
        "meta_only": all(p.device.type == "meta" for p in model.parameters()),
        "plans": plans,
    }


def _forget_plans() -> None:
    """Drop the peak-budget families this process built: the next budget plans from scratch,
    as a fresh process would."""
    from aotgrad.partition import family

    family._FAMILIES.clear()


def _timed_plan(joint: Any, strategy: Any) -> dict[str, Any]:
    """``partition(joint, strategy)``, timed; a refusal (a peak below the floor) as its text."""
    from aotgrad.errors import PartitionError
    from aotgrad.partition import partition

    start, cpu = time.perf_counter(), time.process_time()
    try:
        partitioned = partition(joint, strategy)
    except PartitionError as error:
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        return {"refused": str(error).split(";")[0], "plan_s": seconds, "plan_cpu_s": cpu_seconds}
    return _plan_entry(partitioned, time.perf_counter() - start, time.process_time() - cpu)


def pytorch_worker(
    shape: str, batch: int, seq: int, attention: str, layers: int | None
) -> dict[str, Any]:
    """The reference, in its own fresh process: PyTorch's AOTAutograd (``aot_function``, its
    default partition) capturing the same meta model's first forward and backward."""
    import torch
    from functorch.compile import aot_function, default_partition, make_boxed_func

    model = build(shape, attention, layers)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")

    def loss(state: dict[str, Any], ids: Any) -> Any:
        kwargs = {"input_ids": ids, "labels": ids}
        return torch.func.functional_call(model, state, (), kwargs).loss

    start, cpu = time.perf_counter(), time.process_time()
    step = aot_function(
        loss,
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=default_partition,
    )
    step(state, ids).backward()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {"capture_s": seconds, "capture_cpu_s": cpu_seconds, "rss_mb": _rss_mb()}


def _plan_entry(partitioned: Any, seconds: float, cpu_seconds: float) -> dict[str, Any]:
    peak = partitioned.peak
    return {
        "plan_s": seconds,
        "plan_cpu_s": cpu_seconds,
        "peak_bytes": peak.nbytes,  # what one GPU holds at the step's peak, inputs included
        "allocated_bytes": peak.allocated,  # above the inputs
        "saved_bytes": partitioned.saved_bytes,
        "recompute_flops": partitioned.recompute_flops,
        "where": f"{peak.graph} {peak.op}",
    }


def measure(
    shape: str,
    batch: int | None = None,
    seq: int | None = None,
    attention: str = "cuda_sdpa",
    layers: int | None = None,
    pytorch: bool = False,
    budget: bool = True,
) -> dict[str, Any]:
    """One fresh process for ``shape`` (PyTorch's capture instead with ``pytorch``); its JSON
    line."""
    default_batch, default_seq = SIZES[shape]
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        shape,
        str(batch or default_batch),
        str(seq or default_seq),
        "--attention",
        attention,
    ]
    if layers is not None:
        command += ["--layers", str(layers)]
    if pytorch:
        command.append("--pytorch")
    if not budget:
        command.append("--no-budget")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"meta_scale worker {shape} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def text(found: dict[str, Any]) -> str:
    """A few lines a user reads: the shape, the times, the memory, the predicted peaks."""
    gb = 1e9
    lines = [
        f"{found['shape']} ({found['layers']} layers, {found['param_bytes'] / gb:.1f} GB of bf16"
        f" parameters on meta), batch {found['batch']}, sequence {found['seq']},"
        f" attention {found['attention']}: capture {found['capture_s']:.1f} s"
        f" ({found['capture_cpu_s']:.1f} s CPU)"
        f" ({found['nodes']} nodes), peak RSS {found['rss_mb']:.0f} MB"
        f" ({found['rss_mb_imports']:.0f} MB after imports,"
        f" {found['rss_mb_capture']:.0f} MB after the capture)",
    ]
    for name, plan in found["plans"].items():
        if "refused" in plan:
            lines.append(
                f"  {name:<26} refused: {plan['refused']} ({plan['plan_cpu_s']:.1f} s CPU)"
            )
            continue
        lines.append(
            f"  {name:<26} predicted peak per GPU {plan['peak_bytes'] / gb:7.2f} GB"
            f" ({plan['allocated_bytes'] / gb:.2f} GB above the inputs),"
            f" saved {plan['saved_bytes'] / gb:.2f} GB,"
            f" recompute {plan['recompute_flops'] / 1e12:.2f} TFLOP,"
            f" planned in {plan['plan_s']:.1f} s ({plan['plan_cpu_s']:.1f} s CPU), at {plan['where']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("batch", nargs="?", type=int)
    parser.add_argument("seq", nargs="?", type=int)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attention", default="cuda_sdpa", help="cuda_sdpa, sdpa or eager")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's")
    parser.add_argument("--profile", action="store_true", help="cProfile the budget's planning")
    parser.add_argument("--no-budget", action="store_true", help="save_all and mincut only")
    parser.add_argument("--pytorch", action="store_true", help="PyTorch's capture instead")
    args = parser.parse_args()
    given = (args.shape, args.batch, args.seq, args.attention, args.layers)
    if args.worker and args.pytorch:
        print(json.dumps(pytorch_worker(*given)))
        return
    if args.worker:
        found = worker(*given, budget=not args.no_budget, profile=args.profile)
        print(json.dumps(found))
        return
    for shape in [args.shape] if args.shape else sorted(SHAPES, reverse=True):
        found = measure(
            *(shape, args.batch, args.seq, args.attention, args.layers), budget=not args.no_budget
        )
        print(text(found), flush=True)


if __name__ == "__main__":
    main()
