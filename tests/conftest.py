"""Shared helpers: clone inputs, run eager and compiled, compare everything."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def clone_inputs(tree):
    """Fresh leaf copies with the same values, strides and requires_grad."""

    def clone(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        out = leaf.detach().clone(memory_format=torch.preserve_format)
        return out.requires_grad_(leaf.requires_grad)

    return pytree.tree_map(clone, tree)


def tensor_leaves(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
