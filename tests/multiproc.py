"""Run a function on 2 gloo ranks (processes spawned by ``torch.multiprocessing``) and collect
what each rank returns: the harness of the distributed tests and benchmarks.

The port is a free one chosen at run time on 127.0.0.1; the whole run is bounded by a timeout
(a hung collective fails the test instead of hanging CI). The function must be importable by
name (a module-level function), and what it returns must pickle (tensors, numbers, lists).

>>> run_ranks(_world_size_and_rank)
[(2, 0, tensor([0.])), (2, 1, tensor([1.]))]
"""

from __future__ import annotations

import io
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
TIMEOUT_S = 120.0


@contextmanager
def one_rank_group() -> Iterator[Any]:
    """A one-rank gloo group in this process (its WORLD), for tests of DTensor and process-group
    code that need no second rank. A group already made in this process (the fuzzer keeps one
    for the DTensor arguments of its programs: ``fuzz_programs.one_rank_mesh``) is reused and
    left as it was; one made here is destroyed on exit.

    >>> with one_rank_group() as world:
    ...     dist.get_world_size(world)
    1
    """
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = WORLD_SIZE,
    timeout: float = TIMEOUT_S,
) -> list[Any]:
    """``fn(*args)`` on every rank of a fresh gloo group; the ranks' results in rank order.

    Raises ``RuntimeError`` with the failing rank's traceback, or ``TimeoutError`` when a rank
    has not finished within ``timeout`` seconds (its processes are killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        found = _collect(results, procs, world_size, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [found[rank] for rank in range(world_size)]


def _collect(results: Any, procs: list[Any], world_size: int, timeout: float) -> dict[int, Any]:
    import queue
    import time

    found: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(found) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"distributed run: ranks {sorted(set(range(world_size)) - set(found))} "
                f"did not finish within {timeout:.0f} s"
            )
        try:
            rank, ok, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and results.empty():
                raise RuntimeError(
                    f"distributed run: a rank exited with code {dead[0].exitcode}"
                ) from None
            continue
        if not ok:
            raise RuntimeError(f"distributed run: rank {rank} failed:\n{value}")
        found[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return found


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            results.put((rank, True, _to_bytes(fn(*args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _to_bytes(value: Any) -> bytes:
    """A rank's result as bytes: a tensor put on a Queue as itself travels as shared memory that
    the rank's exit can tear down before the parent reads it (the parent then waits forever)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _world_size_and_rank() -> tuple[int, int, torch.Tensor]:
    return dist.get_world_size(), dist.get_rank(), torch.tensor([float(dist.get_rank())])
