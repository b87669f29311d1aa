"""Which memory a tensor lives in, for strided and sparse tensors alike.

A sparse tensor (COO, CSR, ...) has no single storage: ``untyped_storage()``
raises. Aliasing between inputs or outputs is tracked through storages, and a
sparse tensor aliases nothing but itself, so it is its own key; its size is the
size of its component tensors (indices and values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def storage_key(t: torch.Tensor) -> Any:
    """A hashable key equal for tensors over one storage (a sparse tensor: itself)."""
    if t.layout is torch.strided:
        return ("storage", StorageWeakRef(t.untyped_storage()))
    return ("tensor", id(t))  # never compared with a StorageWeakRef (its == needs one)


def storage_nbytes(t: torch.Tensor) -> Any:
    """Bytes of the storage under ``t`` (a sparse tensor: its indices and values).

    An int, or a SymInt under dynamic shapes: never ``int()`` it here, which
    would specialize the trace on the size (a shape guard).
    """
    if t.layout is torch.strided:
        return t.untyped_storage().nbytes()
    if t.layout is torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    else:
        return t.numel() * t.element_size()
    return sum(p.numel() * p.element_size() for p in parts)
