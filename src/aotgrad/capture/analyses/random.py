"""Random ops draw exactly what eager draws: the same kernel, on the same layout, in order.

Note [Random fills keep their layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A CPU random kernel's numbers depend on the layout of the tensor it fills,
not only on the seed: it draws in memory order, and ``normal_`` even picks
another algorithm for a contiguous tensor. Eager dropout fills a buffer laid
out like its input::

    y = x.t()                          # strides (1, 4)
    mask = empty_like(y).bernoulli_(p)  # draws in memory order of the transposed buffer

Functionalization turns the in-place fill into its functional variant, and
``bernoulli.p`` allocates a *contiguous* result: same numbers, other
places, another mask than eager. So capture records every in-place random
fill of a non-contiguous tensor as ``aotgrad.fill_random(like, "bernoulli_",
[p])``, an op that runs the very same in-place kernel on a fresh tensor of
``like``'s exact size and strides, and copies the result into the target::

    mask = empty_like(y)
    fill = aotgrad.fill_random(mask, "bernoulli_", [p])   # strides (1, 4), eager's draws
    mask = copy(mask, fill)

Decompositions may change what is drawn (``native_dropout`` as ``rand_like
> p`` draws uniforms where eager draws Bernoullis): a decomposition of an op
that draws from the RNG is not used for a call that draws
(:func:`faithful_decompositions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from aotgrad.ops.draws import METADATA_ONLY
from aotgrad.ops.table import draws_random, is_random

# In-place random fills whose arguments after the target are floats: method name per op.
_FILLS = {
    torch.ops.aten.bernoulli_.float: "bernoulli_",
    torch.ops.aten.uniform_.default: "uniform_",
    torch.ops.aten.normal_.default: "normal_",
    torch.ops.aten.exponential_.default: "exponential_",
    torch.ops.aten.cauchy_.default: "cauchy_",
    torch.ops.aten.log_normal_.default: "log_normal_",
    torch.ops.aten.geometric_.default: "geometric_",
}

torch.library.define(
    "aotgrad::fill_random",
    "(Tensor like, str fill, float[] args) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded,),
)


@torch.library.impl("aotgrad::fill_random", "CompositeExplicitAutograd")
def _fill_random(like: torch.Tensor, fill: str, args: Sequence[float]) -> torch.Tensor:
    out = torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device=like.device)
    getattr(out, fill)(*args)
    return out


@torch.library.register_fake("aotgrad::fill_random")
def _fill_random_fake(like: torch.Tensor, fill: str, args: Sequence[float]) -> torch.Tensor:
    return like.new_empty_strided(like.size(), like.stride())


FILL_RANDOM = torch.ops.aotgrad.fill_random.default
METADATA_ONLY[FILL_RANDOM] = frozenset({0})  # draws on an empty tensor laid out like ``like``


def strided_fill(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> tuple[str, list[float]] | None:
    """``(method, float args)`` when ``func`` fills a non-contiguous tensor in place, else None.

    A fill with an explicit generator is left alone (``fill_random`` draws from the default one).
    """
    fill = _FILLS.get(func)
    if fill is None or args[0].is_contiguous() or (kwargs or {}).get("generator") is not None:
        return None
    schema = func._schema.arguments
    floats = [
        args[i] if i < len(args) else (kwargs or {}).get(a.name, a.default_value)
        for i, a in enumerate(schema[1:], start=1)
        if a.name != "generator"
    ]
    return fill, [float(v) for v in floats]


def faithful_decompositions(
    table: Mapping[Any, Callable[..., Any]] | None,
) -> Mapping[Any, Callable[..., Any]] | None:
    """``table`` with each random op's decomposition used only for calls that draw nothing."""
    if not table or not any(is_random(op) for op in table):
        return table
    return {op: _unless_drawing(op, fn) if is_random(op) else fn for op, fn in table.items()}


def _unless_drawing(op: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    def decompose(*args: Any, **kwargs: Any) -> Any:
        if draws_random(op, args, kwargs):
            return NotImplemented  # the op itself is recorded, and runs eager's kernel
        return fn(*args, **kwargs)

    return decompose


# Note [Reseeding inside the function]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.manual_seed(0)`` in the traced function is Python: it would run once, at
# capture, while eager reseeds on every call. When it comes before every random op of
# the function (OpInfo's sample inputs, test harnesses), the numbers each call draws
# depend on that seed alone, so capture records the reseed as an op of the forward
# graph, where it was called, and every call runs it before its random ops::
#
#     def f(x):
#         torch.manual_seed(0)            # -> aotgrad.manual_seed(0, 'default')
#         return F.dropout(x, 0.5)        # draws what eager draws after manual_seed(0)
#
#     forward(x):
#         manual_seed = torch.ops.aotgrad.manual_seed.default(0, 'default')
#         empty_like = torch.ops.aten.empty_like.default(x)
#         bernoulli = torch.ops.aten.bernoulli.p(empty_like, 0.5)    # dropout's mask
#         ...
#
# The generator is left as eager leaves it: reseeded, then stepped by the same draws.
# The seed is a Python int of the trace, like any other (an argument or a global the
# function reads is part of the cache key: another seed traces again). The op runs
# the real ``torch.manual_seed`` (``torch.cuda.manual_seed``, ``..._all`` for those),
# which seeds every device, as eager's call does; it is side-effectful, so dead-code
# elimination keeps it even though nothing uses its (absent) result.
#
# Refused, at the user's line, as before: a reseed after a random op (the draws before
# it come from the caller's stream, the ones after from the seed: no single op at the
# start replays that), a reseed the backward runs (inside a checkpointed region,
# re-run by the recompute), ``torch.seed()`` and ``torch.cuda.seed()`` (a fresh seed
# each call, which Python at capture cannot replay), and a ``torch.set_rng_state`` in
# the forward after a reseed (``torch.random.fork_rng`` restoring the caller's stream
# at its exit would run once, at capture).

torch.library.define("aotgrad::manual_seed", "(int seed, str generator) -> ()")

# The real seeding functions, taken before any trace replaces them (``rng_stand_ins``).
_SEEDERS: dict[str, Callable[[int], Any]] = {
    "default": torch.random.manual_seed,
    "cuda": torch.cuda.manual_seed,
    "cuda_all": torch.cuda.manual_seed_all,
}


@torch.library.impl("aotgrad::manual_seed", "CompositeExplicitAutograd")
def _manual_seed(seed: int, generator: str) -> None:
    _SEEDERS[generator](seed)


@torch.library.register_fake("aotgrad::manual_seed")
def _manual_seed_fake(seed: int, generator: str) -> None:
    return None  # at capture the generator is left alone: the op is recorded, not run


MANUAL_SEED = torch.ops.aotgrad.manual_seed.default
torch.fx.node.has_side_effect(MANUAL_SEED)


def seed_as_int64(seed: Any) -> int:
    """``seed`` as the op's ``int`` (int64): the generators take ``[-2**63, 2**64)``,
    a negative seed standing for its two's complement; the same bits, the same state."""
    value = int(seed)
    return value - (1 << 64) if value >= (1 << 63) else value
