"""The disk cache (issue 17): capture in a second process, with the cache, vs the first process.

Each repeat takes a fresh cache directory and runs two fresh processes on gpt4:
the first finds the directory empty (it traces and writes the entry), the
second finds the entry. In each, the model runs one eager forward+backward
first (so neither pays the first use of each kernel), then the timed part:
wrap, first forward+backward. For ``torch.compile`` that includes Dynamo's own
bytecode tracing, which aotgrad does not cache; the ``aotgrad`` time is the
part inside aotgrad (the miss: trace or load, compile, first forward).
Run as a script it measures one process: ``python bench/persist.py aot_module DIR``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import make

FRONTENDS = ("aot_module", "compile")


def _loss(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def one_process(frontend: str) -> dict[str, float]:
    """Seconds to wrap and run a first forward+backward, and aotgrad's part of it."""
    torch.set_num_threads(1)
    model, args = make("gpt4", 0)
    _loss(model(*args)).backward()
    model.zero_grad()
    inside = [0.0]
    miss = aotgrad.api.AOTFunction._miss

    def timed_miss(self: Any, *a: Any) -> Any:
        start = time.perf_counter()
        try:
            return miss(self, *a)
        finally:
            inside[0] += time.perf_counter() - start

    aotgrad.api.AOTFunction._miss = timed_miss  # type: ignore[method-assign]
    start = time.perf_counter()
    if frontend == "compile":
        compiled: Any = torch.compile(model, backend="aotgrad")
    else:
        compiled = aotgrad.aot_module(model)
    _loss(compiled(*args)).backward()
    return {"total": time.perf_counter() - start, "aotgrad": inside[0]}


def _run(frontend: str, directory: str) -> dict[str, float]:
    env = {**os.environ, "AOTGRAD_CACHE": "1", "AOTGRAD_CACHE_DIR": directory}
    out = subprocess.run(
        [sys.executable, __file__, frontend],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(repeats: int = 3) -> dict[str, dict[str, float]]:
    """Per frontend, medians over ``repeats`` of first- and second-process seconds."""
    runs: dict[str, list[dict[str, float]]] = {f: [] for f in FRONTENDS}
    for _ in range(repeats):
        for frontend in FRONTENDS:
            with tempfile.TemporaryDirectory() as directory:
                first, second = _run(frontend, directory), _run(frontend, directory)
            runs[frontend].append(
                {
                    "first total": first["total"],
                    "second total": second["total"],
                    "first aotgrad": first["aotgrad"],
                    "second aotgrad": second["aotgrad"],
                }
            )
    return {
        frontend: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        for frontend, rs in runs.items()
    }


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(one_process(sys.argv[1])))
    else:
        print(json.dumps(measure(), indent=1))
