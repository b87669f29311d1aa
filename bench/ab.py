"""Capture time of two revisions of aotgrad, interleaved: is a change a regression or noise?

Each revision is checked out (detached) into a temporary git worktree; each measurement is
``bench/library_capture.py MODEL aotgrad`` (wrap, then the first forward+backward with nop
compilers, disk cache off) in a fresh process with that revision's ``src`` first on the
path, revisions taking turns model by model, so load on the machine hits both alike. The
bench script itself is this checkout's. Prints per model the median of each side, their
ratio, and the spread (max/min) of each side: a ratio inside the spread is noise.

    python bench/ab.py 628b3f1 HEAD --repeats 5
    python bench/ab.py HEAD HEAD --env-b AOTGRAD_FAST=0   # one revision, fast path off in B
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import run_fresh  # fresh processes, the disk cache off
from library_capture import MODELS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(Path(__file__).resolve().parent / "library_capture.py")


def checkout(rev: str, into: Path) -> Path:
    """``rev``'s tree in a detached worktree at ``into``; its ``src`` folder."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(into), rev], check=True
    )
    return into / "src"


def measure(src: Path, model: str, env: dict[str, str]) -> float:
    saved = dict(os.environ)
    os.environ.update(env, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    try:
        return float(run_fresh(SCRIPT, model, "aotgrad"))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--env-b", action="append", default=[], help="NAME=VALUE for side B")
    args = parser.parse_args()
    env_b = dict(item.split("=", 1) for item in args.env_b)
    models = args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"a": checkout(args.a, Path(tmp, "a")), "b": checkout(args.b, Path(tmp, "b"))}
        envs = {"a": {}, "b": env_b}
        try:
            for side in ("a", "b"):  # writes each tree's bytecode caches; not counted
                measure(sides[side], models[0], envs[side])
            times: dict[str, dict[str, list[float]]] = {m: {"a": [], "b": []} for m in models}
            for _ in range(args.repeats):
                for model in models:
                    for side in ("a", "b"):
                        times[model][side].append(measure(sides[side], model, envs[side]))
        finally:
            for path in (Path(tmp, "a"), Path(tmp, "b")):
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)])
    print(f"A = {args.a}, B = {args.b} {' '.join(args.env_b)}; median of {args.repeats}")
    ratios = []
    for model, side in times.items():
        a, b = (sorted(side[s])[len(side[s]) // 2] for s in ("a", "b"))
        spread = max(max(side[s]) / min(side[s]) for s in ("a", "b"))
        ratios.append(b / a)
        print(f"{model:14s} A {a:.3f} s  B {b:.3f} s  B/A {b / a:.2f}  spread {spread:.2f}")
    print(f"worst B/A {max(ratios):.2f}, geometric mean {statistics.geometric_mean(ratios):.2f}")


if __name__ == "__main__":
    main()
