"""Train a small MLP on 2 processes with aotgrad: DDP, FSDP2 and tensor parallelism.

    python examples/distributed.py              # ddp, fsdp and tp: 3 SGD steps each
    python examples/distributed.py ddp fsdp     # some of them

Each process trains the model eagerly and through ``aotgrad.aot_module``, and checks that the
losses and the parameters after the steps are the same. On CPU it uses gloo; with one GPU per
process the same code uses NCCL and ``cuda:<rank>`` (nothing else changes).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import aotgrad

WORLD_SIZE = 2
STEPS = 3


def mlp() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def parallelize(kind: str, model: nn.Sequential, device: torch.device) -> nn.Module:
    """The model wrapped as ``kind`` says: "ddp", "fsdp" (FSDP2) or "tp" (tensor parallel)."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = dist.device_mesh.init_device_mesh(device.type, (WORLD_SIZE,))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0], mesh=mesh)  # one unit per block: all-gathered before its forward
        fully_shard(model[2], mesh=mesh)
        return fully_shard(model, mesh=mesh)  # and the root, which aotgrad is given
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # weights become DTensors
    return parallelize_module(model, mesh, plan)


def train(kind: str, compiled: bool, device: torch.device) -> tuple[list[float], nn.Module]:
    model = parallelize(kind, mlp().to(device), device)
    step = aotgrad.aot_module(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Data parallel: each rank its own batch. Tensor parallel: the same batch on every rank.
    torch.manual_seed(0 if kind == "tp" else 1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 16, device=device)
        loss = step(x).pow(2).mean()
        loss.backward()  # DDP all-reduces, FSDP2 reduce-scatters the gradients
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor: FSDP2 and tensor parallel hold DTensor shards."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def worker(rank: int, port: int, kinds: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=WORLD_SIZE)
    try:
        for kind in kinds:
            eager_losses, eager = train(kind, compiled=False, device=device)
            aot_losses, aot = train(kind, compiled=True, device=device)
            torch.testing.assert_close(aot_losses, eager_losses)
            for (name, p), q in zip(eager.named_parameters(), aot.parameters(), strict=True):
                torch.testing.assert_close(full(q), full(p), msg=f"{kind}: {name}")
            print(f"rank {rank} {kind}: losses {[round(x, 4) for x in aot_losses]} as eager")
    finally:
        dist.destroy_process_group()
    # The work is done and checked: skip the interpreter's teardown, where a C++ thread of
    # torch.distributed left joinable aborts the process now and then ("terminate called
    # without an active exception", about one run in six on a loaded CPU machine).
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    kinds = sys.argv[1:] or ["ddp", "fsdp", "tp"]
    mp.spawn(worker, args=(free_port(), kinds), nprocs=WORLD_SIZE)
