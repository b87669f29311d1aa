"""Dynamic shapes: symbolic sizes in the graphs, and the guards that say which sizes they serve.

Note [Dynamic shapes]
~~~~~~~~~~~~~~~~~~~~~
With ``dynamic=True`` (every dimension of the user's tensors but those of
size 0 or 1) or ``aotgrad.dynamic(x, dim=0)`` (chosen dimensions; Note
[Marking dimensions dynamic]), capture gives the fake inputs symbolic sizes
from a ``ShapeEnv``; the graphs compute with ``sym_size`` nodes instead of
constants, and sizes the backward needs are saved like tensors (``saved:
sym_size_int``). Tracing records guards on the symbols (``s0 >= 2``, say);
one compiled entry serves every call whose sizes satisfy them::

    m = nn.Sequential(nn.Linear(16, 16, bias=False), nn.ReLU())
    trace(lambda x: m(x).sum(), x: f32[8, 16] requiring grad, dynamic=True)
    forward(w: f32[16, 16], x: f32[s0, 16])
        -> (out, w, x, sym_size_int, relu)    # saved: w, x, s0 (the batch), relu
    guards: 2 <= s0

Parameters, buffers and unmarked dimensions stay static. Every size the
trace specialized is a guard too (Note [Specializations are guards]); a call
failing the guards traces again, next to the old entry. Outputs or mutations
whose layout depends on a symbol (views, ``t_()``) are rebuilt at each call
from the real sizes (Note [Symbolic layouts] in ``aliasing.py``).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # sympy loads with it: only a capture with symbolic sizes imports it
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, StatelessSymbolicContext

from aotgrad._torch_compat import local_source
from aotgrad.signature.storage import storage_key

# Per leaf of a call, its dimensions with symbolic sizes (``()``: static; Note [Dynamic shapes]).
DynamicDims = tuple[tuple[int, ...], ...]

# Note [Marking dimensions dynamic]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Which dimensions are dynamic is said explicitly, three ways:
#
#     aot_function(f, dynamic=True)      every dimension of size > 1 of the call's tensors
#     aotgrad.dynamic(x, dim=0)          a mark on that tensor (as torch._dynamo.mark_dynamic)
#     AOTFunction(..., dynamic_dims=d)   fixed per leaf: Dynamo's symbolic dimensions
#
# ``requested_dims`` reads them once per call, where the call's key is built,
# into a per-leaf tuple that the key holds (a change of dimensions is a miss
# that says so) and capture receives. ``aotgrad.dynamic`` stays public: the mark
# is the user's own statement about that tensor, kept on it, like Dynamo's. No
# global state records that a mark was ever made, so marks cost one attribute
# read per tensor on calls that build a key (not on the last entry's fast path,
# Note [The last entry]), and the Dynamo backend hands its dimensions to the
# ``AOTFunction`` once instead of marking the caller's tensors on every call.
# (Examples: ``requested_dims``.)
_ATTRIBUTE = "_aotgrad_dynamic_dims"


def dynamic(x: torch.Tensor, dim: int | Sequence[int] = 0) -> torch.Tensor:
    """Mark ``x``'s dimension(s) ``dim`` dynamic for aotgrad's traces; returns ``x``.

    The mark stays on ``x`` (Note [Marking dimensions dynamic]).

    >>> import torch, aotgrad
    >>> x = aotgrad.dynamic(torch.ones(8, 4), dim=-1)
    >>> aotgrad.capture.analyses.dynamic.marked_dims(x)
    (1,)
    """
    dims = [dim] if isinstance(dim, int) else list(dim)
    marked = set(getattr(x, _ATTRIBUTE, ()))
    marked.update(d % x.dim() for d in dims)
    setattr(x, _ATTRIBUTE, frozenset(marked))
    return x


def marked_dims(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions :func:`dynamic` marked on ``x``, in order."""
    marked = getattr(x, _ATTRIBUTE, None)
    return () if marked is None else tuple(sorted(marked))


def all_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Every dimension that can vary: sizes 0 and 1 stay static (they change broadcasting)."""
    return tuple(d for d, n in enumerate(x.shape) if n > 1)


def requested_dims(leaves: Sequence[Any], everything: bool) -> DynamicDims | None:
    """Per leaf, its dynamic dimensions; None when none is (Note [Marking dimensions dynamic]).

    >>> x = dynamic(torch.ones(8, 4), dim=0)
    >>> requested_dims([x, torch.ones(3, 2), 2.0], everything=False)
    ((0,), (), ())
    >>> requested_dims([torch.ones(8, 4), torch.ones(1, 5)], everything=True)
    ((0, 1), (1,))
    >>> requested_dims([torch.ones(8, 4)], everything=False) is None
    True
    """
    if not everything and not any(
        [isinstance(leaf, torch.Tensor) and hasattr(leaf, _ATTRIBUTE) for leaf in leaves]
    ):
        return None  # the common case: one attribute read per tensor
    dims_of = all_dims if everything else marked_dims
    dims = tuple(dims_of(leaf) if isinstance(leaf, torch.Tensor) else () for leaf in leaves)
    return dims if any(dims) else None


# Note [Inputs that share memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inputs over one storage are traced as views of one synthetic base (Note [Aliased
# inputs]) whose places in it -- sizes, strides, offsets -- the graph holds as
# constants, and whether their memory overlaps decides whether eager even runs the
# function (Note [Writes that read overlapping memory]). Neither may change between
# calls an entry serves, so such inputs are static even when dimensions are asked to
# be dynamic: their exact layout is in the call key::
#
#     f = aot_function(lambda a, b: a.add_(b), dynamic=True)
#     f(x[0:4], x[6:10])   a, b share x: static; traced for a 4-element a
#     f(x[0:3], x[6:9])    another key: traced again (was served the 4-element graph)
#     f(x[0:6], x[4:10])   another key: overlapping, eager's RuntimeError at capture
#
# Inputs that share memory with no other input keep their dynamic dimensions. The key
# finds sharing through views, repeats and storage addresses (``x`` and ``x.detach()``
# share memory without a view: ``alias_key``). A ``Traced``, which never re-traces,
# compares the call's ``memory_sharing`` with the capture's and refuses a difference.


def static_where_shared(
    leaves: Sequence[Any], dims: DynamicDims, others: Sequence[torch.Tensor] = ()
) -> DynamicDims | None:
    """``dims`` without the dimensions of tensor leaves that share their storage with
    another distinct tensor (a leaf or one of ``others``); None when none is left
    (Note [Inputs that share memory])."""
    tensors = {id(t): t for t in [*others, *leaves] if isinstance(t, torch.Tensor)}
    sharing = collections.Counter(storage_key(t) for t in tensors.values())
    kept = tuple(
        () if isinstance(leaf, torch.Tensor) and sharing[storage_key(leaf)] > 1 else leaf_dims
        for leaf, leaf_dims in zip(leaves, dims, strict=True)
    )
    return kept if any(kept) else None


def _sympy_interp() -> dict[str, Any]:
    """The names guard expressions use (``Eq``, ``Mod``...); loaded once a ShapeEnv exists."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return SYMPY_INTERP


def symbolic_context(x: torch.Tensor, dims: Sequence[int]) -> StatelessSymbolicContext:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(x.dim())]
    return StatelessSymbolicContext(dynamic_sizes=sizes)


# Note [Specializations are guards]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Tracing may turn a symbolic size into a constant: ``int(y.shape[1])``, or an
# op whose meta function branches on a size (``F.pad`` then ``reshape(-1)``),
# records ``Eq(s1, 4)`` and replaces ``s1`` by 4 in everything after. The graph
# is then only valid at width 4. ``produce_guards`` skips such sizes by default
# (``ignore_static``: Dynamo checks static sizes elsewhere), and the call key
# leaves dynamic dimensions out, so nothing would check them. aotgrad asks for
# every guard, static values included, of every input with a symbolic size::
#
#     f = aot_function(lambda y: y * int(y.shape[1]), dynamic=True)
#     f(ones(2, 4))   guards: y.size()[1] == 4 and y.stride()[0] == 4 and 2 <= y.size()[0]
#     f(ones(2, 6))   fails y.size()[1] == 4: traced again (cache_info names the guard)
#
# Inputs without symbols (parameters, buffers, static tensors) are left out:
# the call key already holds their exact metadata.


@dataclass
class ShapeGuards:
    """The conditions on symbolic sizes under which a traced graph is valid."""

    shape_env: ShapeEnv
    # The fake graph inputs, in graph order.
    placeholders: Sequence[Any]
    # The user's name for each graph input, for messages ("x", "param fc1.weight").
    names: Sequence[str] = ()
    _terms: list[str] | None = field(default=None, repr=False)
    _code: Any = field(default=None, repr=False)

    def terms(self) -> list[str]:
        """Every guard, as Python over ``L['t<i>']`` (graph input ``i``)."""
        if self._terms is None:
            symbolic = [i for i, p in enumerate(self.placeholders) if _has_symbols(p)]
            self._terms = self.shape_env.produce_guards(
                [self.placeholders[i] for i in symbolic],
                [local_source(f"t{i}") for i in symbolic],
                ignore_static=False,  # Note [Specializations are guards]
            )
        return self._terms

    def expression(self) -> str | None:
        return " and ".join(self.terms()) or None

    def check(self, inputs: Sequence[Any]) -> bool:
        """Do real ``inputs`` (graph order) satisfy the guards?"""
        if self._code is None:
            text = self.expression()
            self._code = compile(text, "<aotgrad guards>", "eval") if text else False
        if self._code is False:
            return True
        return bool(eval(self._code, _sympy_interp(), {"L": _locals(inputs)}))

    def failed(self, inputs: Sequence[Any]) -> str | None:
        """The first guard ``inputs`` fail, in the user's names; None when all pass."""
        scope = {"L": _locals(inputs)}
        for term in self.terms():
            if not eval(term, _sympy_interp(), scope):
                return self.describe(term)
        return None

    def value_of(self, inputs: Sequence[Any]) -> Callable[[Any], int]:
        """Evaluates a ``SymInt`` of the trace at real ``inputs`` (graph order); ints pass."""
        bindings = self.shape_env.bind_symbols(self.placeholders, inputs)
        shape_env = self.shape_env

        def value_of(value: Any) -> int:
            if not isinstance(value, torch.SymInt):
                return int(value)
            return int(shape_env.replace(value.node.expr).xreplace(bindings))

        return value_of

    def describe(self, term: str) -> str:
        """``L['t0'].size()[1] == 4`` → ``y.size()[1] == 4``."""
        names = self.names
        return _INPUT.sub(lambda m: names[int(m[1])] if int(m[1]) < len(names) else m[0], term)


_INPUT = re.compile(r"L\['t(\d+)'\]")


def _locals(inputs: Sequence[Any]) -> dict[str, Any]:
    return {f"t{i}": value for i, value in enumerate(inputs)}


def _has_symbols(value: Any) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if not isinstance(value, torch.Tensor):
        return False
    sizes = [*value.shape, *value.stride(), value.storage_offset()]
    return any(isinstance(n, torch.SymInt) for n in sizes)
