"""The function whose disk-cache entry seeds tests/store_fuzz.py: in a module of its own, since
an entry's key reads the source of every module the function's globals name (hypothesis has a
module without a source file)."""

import torch


def entry_fn(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).tanh()
