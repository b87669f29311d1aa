"""The disk cache (issue 17): capture in a second process, with the cache, vs the first process.

Each repeat takes a fresh cache directory and runs two fresh processes on gpt4:
the first finds the directory empty (it traces and writes the entry), the
second finds the entry. In each, the model runs one eager forward+backward
first (so neither pays the first use of each kernel), then the timed part:
wrap, first forward+backward. Three times are taken in each process:

- ``total``: wrap to the end of the first backward. It holds the model's own
  forward and backward kernels (~0.18 s of gpt4, in both processes) and, for
  ``torch.compile``, Dynamo's bytecode tracing, which aotgrad does not cache;
- ``aotgrad``: the time inside aotgrad -- ``AOTFunction._miss`` (key, trace or
  load, compile, first call) and, for ``torch.compile``, aotgrad's backend
  building the ``AOTFunction`` -- less the first call (``first call``), whose
  kernels a cache cannot skip. This is what the cache replaces: tracing and
  compiling against finding, reading and compiling the stored graphs;
- ``first call``: the first forward through the graphs, inside the miss.

``measure(pytorch=True)`` also runs PyTorch's own ``torch.compile`` (Inductor)
in the same way, its caches (FX graph cache, AOTAutogradCache) in the fresh
directory: the reference for what a second process of PyTorch's saves.
Run as a script it measures one process: ``python bench/persist.py aot_module``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import aotgrad
import aotgrad.api
import aotgrad.cache
import aotgrad.dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import make

FRONTENDS = ("aot_module", "compile")


def _loss(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Clock:
    """Seconds spent inside aotgrad's miss, its first call, and its Dynamo backend."""

    def __init__(self) -> None:
        self.times = {"miss": 0.0, "first call": 0.0, "backend": 0.0}
        self.in_miss = False

    def wrap(self, label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            counted = label != "first call" or self.in_miss
            start = time.perf_counter()
            self.in_miss = self.in_miss or label == "miss"
            try:
                return fn(*args, **kwargs)
            finally:
                if label == "miss":
                    self.in_miss = False
                if counted:
                    self.times[label] += time.perf_counter() - start

        return timed


def one_process(frontend: str) -> dict[str, float]:
    """Seconds to wrap and run a first forward+backward, aotgrad's part, and its first call."""
    torch.set_num_threads(1)
    model, args = make("gpt4", 0)
    _loss(model(*args)).backward()
    model.zero_grad()
    clock = _Clock()
    aotgrad.api.AOTFunction._miss = clock.wrap("miss", aotgrad.api.AOTFunction._miss)  # type: ignore[method-assign]
    aotgrad.cache.Entry.__call__ = clock.wrap("first call", aotgrad.cache.Entry.__call__)  # type: ignore[method-assign]
    backend = aotgrad.dynamo.backend
    aotgrad.dynamo.backend = lambda *a, **k: clock.wrap("backend", backend(*a, **k))  # type: ignore[assignment]
    start = time.perf_counter()
    if frontend == "compile":
        compiled: Any = torch.compile(model, backend="aotgrad")
    elif frontend == "pytorch":
        compiled = torch.compile(model)
    else:
        compiled = aotgrad.aot_module(model)
    _loss(compiled(*args)).backward()
    total = time.perf_counter() - start
    t = clock.times
    return {
        "total": total,
        "aotgrad": t["miss"] + t["backend"] - t["first call"],
        "first call": t["first call"],
    }


def _run(frontend: str, directory: str) -> dict[str, float]:
    env = {
        **os.environ,
        "AOTGRAD_CACHE": "1",
        "AOTGRAD_CACHE_DIR": directory,
        "TORCHINDUCTOR_CACHE_DIR": str(Path(directory) / "inductor"),
    }
    out = subprocess.run(
        [sys.executable, __file__, frontend],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(repeats: int = 3, pytorch: bool = False) -> dict[str, dict[str, float]]:
    """Per frontend, medians over ``repeats`` of first- and second-process seconds."""
    frontends = (*FRONTENDS, "pytorch") if pytorch else FRONTENDS
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in frontends}
    for i in range(repeats):
        for frontend in frontends:
            if frontend == "pytorch" and i > 0:
                continue  # Inductor's first compile takes a minute: one repeat
            with tempfile.TemporaryDirectory() as directory:
                first, second = _run(frontend, directory), _run(frontend, directory)
            runs[frontend].append(
                {
                    f"{which} {k}": v
                    for which, r in (("first", first), ("second", second))
                    for k, v in r.items()
                }
            )
    return {
        frontend: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        for frontend, rs in runs.items()
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):
        print(json.dumps(one_process(sys.argv[1])))
    else:
        print(json.dumps(measure(pytorch="--pytorch" in sys.argv), indent=1))
