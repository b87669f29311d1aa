"""Planning time of a peak budget (issue 42, item 1): aotgrad ``budget(peak=mid)`` against
PyTorch's ``activation_memory_budget=0.5``, per model, in fresh processes.

Planning is a capture with the plan minus a capture without one, each in its own fresh
process with its imports in (aotgrad: ``aotgrad.trace`` with ``budget(peak=mid)`` minus with
``save_all``; PyTorch: ``aot_function`` over ``torch.func.functional_call`` with
``min_cut_rematerialization_partition`` at ``activation_memory_budget=0.5`` minus with
``default_partition``, nop compilers, the first forward). Seconds are the process's CPU
time (``time.process_time``): on this shared, loaded machine wall time measures the other
tenants too; with one thread the two agree on an idle one. ``mid`` is halfway between
save_all's predicted peak and the smallest the family reaches (what ``budget(peak=0)``'s
error names), found in a process of its own beforehand. One thread.

Models: the benchmark GPT (``bench_models.make``: d_model 256, sequence 128, batch 4) at 12, 24
and 48 blocks, and transformers' Llama from ``tests/library_models.py`` (its random config)
with 32 layers, at batch 8 and sequence 32 (its peak in the backward, where plans move it). As a script: ``python bench/planning.py gpt12 aotgrad plan 123456`` times
one capture in this process; ``python bench/planning.py all [repeats]`` runs the suite.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

MODELS = ("gpt12", "gpt24", "gpt48", "llama32")
TOOLS = ("aotgrad", "pytorch")
PYTORCH_BUDGET = 0.5
LIBRARY_SIZE = (8, 32)  # batch, sequence


def make(name: str) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    """Model, args, kwargs and loss-of-output for ``name``."""
    if name.startswith("gpt"):
        from bench_models import make as make_gpt

        model, args = make_gpt(name)
        return model, args, {}, lambda out: out
    import library_models  # first: it quiets transformers before the model loads

    case = library_models.build(name.rstrip("0123456789"))
    config = copy.deepcopy(case.model.config)
    config.num_hidden_layers = int(name[len(name.rstrip("0123456789")) :])
    torch.manual_seed(0)
    model = type(case.model)(config).train()
    args, kwargs = case.resized(*LIBRARY_SIZE)
    return model, args, kwargs, case.loss


def capture_aotgrad(name: str, mode: str, peak: int) -> float:
    import aotgrad

    model, args, kwargs, loss = make(name)
    partition = aotgrad.budget(peak=peak) if mode == "plan" else "save_all"

    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        return loss(model(*args, **kwargs))

    start = time.process_time()
    aotgrad.trace(step, *args, partition=partition, **kwargs)
    return time.process_time() - start


def capture_pytorch(name: str, mode: str, peak: int) -> float:
    import torch._functorch.config as functorch_config
    from functorch.compile import (
        aot_function,
        default_partition,
        min_cut_rematerialization_partition,
    )

    import aotgrad
    from aotgrad.capture.tracing.joint import compiling

    model, args, kwargs, loss = make(name)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def fn(state: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        return loss(torch.func.functional_call(model, state, args, kwargs))

    plan = mode == "plan"
    partition = min_cut_rematerialization_partition if plan else default_partition
    budget = PYTORCH_BUDGET if plan else 1.0
    start = time.process_time()
    compiled = aot_function(fn, fw_compiler=aotgrad.nop, partition_fn=partition)
    # transformers' mask code takes its traceable branch only when told it is being compiled,
    # as aotgrad's capture does (Note [Capture is compiling]).
    with compiling(), functorch_config.patch(activation_memory_budget=budget):
        compiled(state, args, kwargs)  # captures and partitions; the forward runs once
    return time.process_time() - start


def mid_peak(name: str) -> int:
    """Halfway between save_all's predicted peak and the family's smallest."""
    import aotgrad
    from aotgrad.partition import partition

    model, args, kwargs, loss = make(name)
    traced = aotgrad.trace(lambda *a, **k: loss(model(*a, **k)), *args, **kwargs)
    top = traced.partitioned.peak.allocated
    try:
        partition(traced.partitioned.joint, aotgrad.budget(peak=0))
    except ValueError as error:
        floor = int(re.search(r"candidate plans is (\d+) bytes", str(error))[1])  # type: ignore[index]
    return (top + floor) // 2


RUN = {"aotgrad": capture_aotgrad, "pytorch": capture_pytorch}


def measure(name: str, tool: str, mode: str, peak: int) -> float:
    """Seconds to capture (and plan, ``mode`` "plan") ``name`` with ``tool`` in this process."""
    torch.set_num_threads(1)
    return RUN[tool](name, mode, peak)


def measure_in_fresh_processes(
    names: tuple[str, ...] = MODELS, repeats: int = 3
) -> dict[str, dict[str, Any]]:
    """Per model: each tool's planning seconds per repetition (plan minus base, fresh
    processes taking turns), and the aotgrad/PyTorch ratio per repetition."""
    from capture import run_fresh  # fresh processes, the disk cache off

    found: dict[str, dict[str, Any]] = {}
    for name in names:
        peak = run_fresh(__file__, "peak", name)
        runs: dict[str, list[float]] = {t: [] for t in TOOLS}
        for _ in range(repeats):
            for tool in TOOLS:
                base, plan = (
                    run_fresh(__file__, name, tool, mode, str(peak)) for mode in ("base", "plan")
                )
                runs[tool].append(max(plan - base, 1e-3))
        ratios = [a / p for a, p in zip(runs["aotgrad"], runs["pytorch"], strict=True)]
        found[name] = {**runs, "ratios": ratios, "peak": peak}
    return found


def _print_suite(repeats: int) -> None:
    for name, got in measure_in_fresh_processes(MODELS, repeats).items():
        ours, theirs = (" ".join(f"{t:.2f}" for t in got[k]) for k in TOOLS)
        print(
            f"{name:8s} aotgrad {ours} s  pytorch {theirs} s  ratios"
            f" {' '.join(f'{r:.2f}' for r in got['ratios'])} (worst {max(got['ratios']):.2f})",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1] == "all":
        _print_suite(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    elif sys.argv[1] == "peak":
        torch.set_num_threads(1)
        print(json.dumps(mid_peak(sys.argv[2])))
    else:
        print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
