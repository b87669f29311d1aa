"""Small tensor subclasses for the subclass tests (Note [Tensor subclasses]).

``TwoTensor`` is a traceable wrapper: it holds two plain tensors ``a`` and ``b`` of one shape,
and every op runs on both. ``Tagged`` is a subclass without ``__tensor_flatten__``, which
aotgrad refuses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


class TwoTensor(torch.Tensor):
    """A wrapper of two same-shaped tensors; each op applies to ``a`` and to ``b``.

    >>> t = TwoTensor(torch.ones(2), torch.zeros(2)) * 2
    >>> t.a, t.b
    (tensor([2., 2.]), tensor([0., 0.]))
    """

    a: torch.Tensor
    b: torch.Tensor

    @staticmethod
    def __new__(
        cls,
        a: torch.Tensor,
        b: torch.Tensor,
        outer_size: Any = None,
        outer_stride: Any = None,
        requires_grad: bool | None = None,
    ) -> TwoTensor:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
        size = a.size() if outer_size is None else outer_size
        stride = a.stride() if outer_stride is None else outer_stride
        grad = a.requires_grad if requires_grad is None else requires_grad
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            size,
            strides=stride,
            storage_offset=a.storage_offset(),
            dtype=a.dtype,
            device=a.device,
            layout=a.layout,
            requires_grad=grad,
        )

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        outer_size: Any = None,
        outer_stride: Any = None,
        requires_grad: bool | None = None,
    ) -> None:
        self.a = a
        self.b = b

    def __repr__(self) -> str:  # type: ignore[override]
        return f"TwoTensor(a={self.a!r}, b={self.b!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], context: Any, outer_size: Any, outer_stride: Any
    ) -> TwoTensor:
        return TwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        on_a = pytree.tree_map_only(TwoTensor, lambda t: t.a, (args, kwargs))
        on_b = pytree.tree_map_only(TwoTensor, lambda t: t.b, (args, kwargs))
        out_a = func(*on_a[0], **on_a[1])
        out_b = func(*on_b[0], **on_b[1])
        flat_a, spec = pytree.tree_flatten(out_a)
        flat_b = pytree.tree_leaves(out_b)
        both = [
            TwoTensor(x, y) if isinstance(x, torch.Tensor) else x
            for x, y in zip(flat_a, flat_b, strict=True)
        ]
        if func._schema.is_mutable:  # an in-place op returns the tensor it changed
            return args[0]
        return pytree.tree_unflatten(both, spec)


def two(a: torch.Tensor, b: torch.Tensor, requires_grad: bool = False) -> TwoTensor:
    """A leaf ``TwoTensor`` of copies of ``a`` and ``b``."""
    return TwoTensor(a.clone(), b.clone()).requires_grad_(requires_grad)  # type: ignore[return-value]


class Tagged(torch.Tensor):
    """A subclass without ``__tensor_flatten__``: not a traceable wrapper."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Tagged:
        return torch.Tensor._make_subclass(cls, data)  # type: ignore[no-any-return]


class Scaled(torch.Tensor):
    """A wrapper of one tensor with a scale kept in its flatten context; each op runs on the
    inner tensor and keeps the scale. Its ``__torch_dispatch__`` keeps the wrapper's own
    metadata in step with in-place view ops (``t_``), as torch's ``TwoTensor`` does.

    >>> s = Scaled(torch.ones(2, 3), 0.5); s.t_().shape, s.inner.shape, s.scale
    (torch.Size([3, 2]), torch.Size([3, 2]), 0.5)
    """

    inner: torch.Tensor
    scale: float

    @staticmethod
    def __new__(
        cls, inner: torch.Tensor, scale: float, outer_size: Any = None, outer_stride: Any = None
    ) -> Scaled:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            inner.size() if outer_size is None else outer_size,
            strides=inner.stride() if outer_stride is None else outer_stride,
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=inner.requires_grad,
        )

    def __init__(
        self, inner: torch.Tensor, scale: float, outer_size: Any = None, outer_stride: Any = None
    ) -> None:
        self.inner = inner
        self.scale = scale

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Scaled({self.inner!r}, scale={self.scale})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["inner"], (self.scale,)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], context: Any, outer_size: Any, outer_stride: Any
    ) -> Scaled:
        return Scaled(inner["inner"], context[0], outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._python_dispatch import return_and_correct_aliasing

        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        scale = next(t.scale for t in leaves if isinstance(t, Scaled))
        plain = pytree.tree_map_only(Scaled, lambda t: t.inner, (args, kwargs))
        out = func(*plain[0], **plain[1])
        out = pytree.tree_map_only(torch.Tensor, lambda t: Scaled(t, scale), out)
        return return_and_correct_aliasing(func, args, kwargs, out)
