"""Time to first gradient (issue 29): process start to the first ``backward()`` returned.

What a new user waits for: a fresh Python process imports torch and the tool, builds the
model, wraps it, runs one forward and backward. Nothing is shared between runs (the disk
cache is off), and the tools take turns run by run so machine noise hits them alike:

    eager     the same script without a tool: the floor every tool adds to
    aotgrad   ``aotgrad.aot_module`` (nop compilers, the default partition)
    pytorch   PyTorch's ``aot_function`` over ``torch.func.functional_call`` with ``nop``
              compilers (its ``aot_module`` refuses tied weights); the process never
              imports aotgrad

Two ratios per model: the whole process, and the time each tool adds to eager's process
(``tool - eager``): the second is the tool's own cost, without the Python start, ``import
torch`` and the model's library, which both tools pay alike and neither can shorten.

    python bench/first_gradient.py              # the suite, medians of 3 fresh processes
    python bench/first_gradient.py gpt4 aotgrad # one child run (prints nothing)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOOLS = ("eager", "aotgrad", "pytorch")
# gpt4 (bench_models) and every model of bench/library_capture.py.
MODELS = ("gpt4", "gpt_explicit", "gpt2", "llama", "bert", "resnet18", "mobilenet_v3")
MODELS += ("efficientnet", "convnext")


def _model(name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
    """Model, args, kwargs and loss-of-output: bench_models' gpt4, library_capture's others."""
    sys.path.insert(0, str(HERE))
    if name == "gpt4":
        from bench_models import make

        model, args = make(name)
        return model, args, {}, lambda out: out.sum() if out.dim() else out
    sys.path.insert(0, str(HERE.parent / "tests"))
    from library_capture import make as make_library

    return make_library(name)


def child(name: str, tool: str) -> None:
    """One run: imports, build, wrap, forward, backward; then exit at once."""
    import torch

    if tool == "aotgrad":
        import aotgrad
    elif tool == "pytorch":
        from functorch.compile import aot_function, default_partition, nop
    model, args, kwargs, loss = _model(name)
    if tool == "aotgrad":
        out = aotgrad.aot_module(model)(*args, **kwargs)
    elif tool == "pytorch":
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

        def fn(state: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
            return torch.func.functional_call(model, state, args, kwargs)

        compiled = aot_function(fn, fw_compiler=nop, partition_fn=default_partition)
        # transformers' mask code takes its traceable branch only while it is told it is
        # compiled, as aotgrad's capture tells it (Note [Capture is compiling]).
        torch.compiler._is_compiling_flag = True
        try:
            out = compiled(state, args, kwargs)
        finally:
            torch.compiler._is_compiling_flag = False
    else:
        out = model(*args, **kwargs)
    loss(out).backward()
    sys.stdout.flush()
    os._exit(0)  # the first gradient is in: the interpreter's teardown is not waited for


def run_once(name: str, tool: str) -> float:
    """Wall seconds of one fresh process, from spawn to exit."""
    env = {**os.environ, "AOTGRAD_CACHE": "0", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, name, tool], check=True, env=env)
    return time.perf_counter() - start


def measure(names: tuple[str, ...] = MODELS, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Per model and tool, the median wall seconds over ``repeats`` fresh processes."""
    runs: dict[str, dict[str, list[float]]] = {n: {t: [] for t in TOOLS} for n in names}
    for _ in range(repeats):
        for name in names:
            for tool in TOOLS:
                runs[name][tool].append(run_once(name, tool))
    return {
        name: {tool: sorted(ts)[len(ts) // 2] for tool, ts in per_tool.items()}
        for name, per_tool in runs.items()
    }


def _importtime(module: str) -> tuple[float, list[tuple[float, str]]]:
    """Seconds ``import module`` takes in a fresh process that imported torch first, read
    from ``python -X importtime``, and its heaviest direct imports (seconds, name)."""
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import torch; import {module}"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    rows = []  # (cumulative us, depth, name), children before their parent
    for line in err.splitlines()[1:]:
        _, _, cumulative, name = (part for part in line.replace("|", ":").split(":"))
        rows.append((int(cumulative), len(name) - len(name.lstrip()), name.strip()))
    start = max(i for i, r in enumerate(rows) if r[2] == "torch" and r[1] == 1) + 1
    after = rows[start:]  # what ``import module`` loaded that torch had not
    children = [(c / 1e6, n) for c, depth, n in after if depth == 3]
    return sum(c for c, depth, _ in after if depth == 1) / 1e6, sorted(children, reverse=True)[:3]


_TIMED_IMPORT = """
import gc, json, sys, time
import torch
full = []
gc.callbacks.append(lambda phase, info: info["generation"] == 2 and full.append(time.perf_counter()))
start = time.perf_counter()
import {module}
end = time.perf_counter()
paused = sum(b - a for a, b in zip(full[::2], full[1::2]))
print(json.dumps([end - start, paused]))
"""


def import_seconds(repeats: int = 5) -> dict[str, Any]:
    """Per module (``aotgrad``, and PyTorch's ``functorch.compile``): the median seconds its
    import adds to ``import torch`` over ``repeats`` fresh processes; the median seconds of
    full garbage collections within it (a collection of torch's objects that the import's
    allocations happen to trigger: the collector's thresholds decide where it lands); and,
    from one ``python -X importtime`` run, its heaviest imports."""
    found: dict[str, Any] = {}
    for module in ("aotgrad", "functorch.compile"):
        code = _TIMED_IMPORT.format(module=module)
        runs = []
        for _ in range(repeats):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            runs.append(json.loads(out.stdout.splitlines()[-1]))
        found[module] = {
            "seconds": sorted(r[0] for r in runs)[len(runs) // 2],
            "collecting": sorted(r[1] for r in runs)[len(runs) // 2],
            "collected in": sum(r[1] > 0 for r in runs),
            "heaviest": _importtime(module)[1],
        }
    return found


def show_seconds(repeats: int = 5) -> dict[str, float]:
    """Median wall seconds of ``aotgrad show examples/carry.py:fn`` and of ``python -c
    "import torch"``, fresh processes taking turns."""
    show = [sys.executable, "-m", "aotgrad.cli", "show", str(HERE.parent / "examples/carry.py:fn")]
    commands = {"show": show, "import torch": [sys.executable, "-c", "import torch"]}
    env = {**os.environ, "AOTGRAD_CACHE": "0"}
    runs: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(repeats):
        for key, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
            runs[key].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in runs.items()}


if __name__ == "__main__":
    if len(sys.argv) == 3:
        child(sys.argv[1], sys.argv[2])
    found = measure()
    for name, t in found.items():
        added = (t["aotgrad"] - t["eager"]) / max(t["pytorch"] - t["eager"], 1e-9)
        print(
            f"{name:14s} eager {t['eager']:.2f}  aotgrad {t['aotgrad']:.2f}  pytorch"
            f" {t['pytorch']:.2f}  whole {t['aotgrad'] / t['pytorch']:.2f}x  added {added:.2f}x"
        )
