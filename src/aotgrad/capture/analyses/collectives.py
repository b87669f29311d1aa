"""Collectives in the graphs: what each one is, and the checks that keep every rank in step.

Note [Collectives]
~~~~~~~~~~~~~~~~~~
A collective (``torch.distributed._functional_collectives``: ``all_reduce``,
``all_gather_tensor``, ``reduce_scatter_tensor``, ...) is an op every rank of
its group must run, the same ones in the same order: a rank that runs another
collective, or the same ones in another order, waits forever for a partner (a
deadlock) or combines unrelated tensors. Capture records the functional ops
(``_c10d_functional.all_reduce`` then ``_c10d_functional.wait_tensor``) like
any other op, in the forward and, through the autograd formulas torch
registers for them, in the backward::

    user code:  y = all_reduce(x @ w, "sum", group)          # group '0': ranks 0, 1
    forward:    mm = mm(x, w); r = all_reduce(mm, 'sum', '0'); y = wait_tensor(r)
    backward:   r_1 = all_reduce(cotangent, 'sum', '0'); g = wait_tensor(r_1); ...

aotgrad keeps five rules (``ops.table.is_collective`` says which ops they cover:
the ``_c10d_functional``, ``_c10d_functional_autograd`` and ``c10d`` ops,
``wait_tensor`` included):

1. Never recomputed. Every partition strategy pins them to the forward:
   min-cut hangs them off the source, the budget program fixes their
   recompute variable at 0, a selective checkpoint's ``MUST_RECOMPUTE`` tag
   is ignored on them, and walking back from what the backward needs stops at
   them (their result is saved)::

       x -> mm -> sin -> all_reduce -> wait -> sin -> out; the backward reads wait
       budget(0.01) without the rule: save x, w; the backward re-runs mm, sin,
                         all_reduce, wait (one all_reduce more per step)
       with it:          save wait; the backward's only all_reduce is the
                         gradient's (its input is a cotangent, not a forward value)

   A checkpointed region (``torch.utils.checkpoint``) re-runs its collectives
   in eager's backward; capture links each re-run collective to its forward
   twin (the same op on the same, linked, inputs: Note [Recomputed random
   ops]) and the backward reads the twin's result instead, which the forward
   saves. A re-run collective with no twin is refused.

2. Never reordered. The forward and backward graphs copy the joint graph's
   nodes in its order, and ``partition`` checks that the collectives of the
   two graphs are the joint graph's, each once, in the same order
   (``check_order``; it raises if a strategy recomputed or moved one). The
   joint graph's order is the order the function called them, the same on
   every rank for the same code and shapes. A compiler may still schedule two
   independent collectives either way::

       a = all_reduce(x); b = all_reduce(y)    # no data dependency between them

   but every rank hands the same graph to the same compiler, whose schedule
   is a function of the graph: whichever order it picks, every rank picks it.
   (aotgrad adds no artificial dependency between collectives.)

3. Checked across ranks. After capture, when ``torch.distributed`` is
   initialized and the graph holds collectives, each rank publishes the
   sequence ``(op, group, group ranks, reduce op, shape, dtype)`` of the
   joint graph's collectives in the default process group's key-value store,
   and reads the sequences of the other ranks of those groups::

       rank 0: all_reduce(sum) over group '1' (ranks 0, 1) of float32[4, 4]
       rank 1: all_reduce(sum) over group '0' (ranks 0, 1) of float32[4, 4]
       -> CollectiveMismatchError on both ranks, naming the op and both groups

   The check sends no collective of its own: a store read cannot be matched
   with another rank's collective and hang there, and it waits at most
   ``CHECK_TIMEOUT_S``. A rank that publishes nothing in that time (it did not
   capture this function, e.g. its call hit the cache while this rank's
   missed) is not proof of a mismatch: the check warns
   (``CollectiveCheckWarning``) and the capture goes on. (A capture on one
   rank only, say ``aotgrad.trace`` under ``if rank == 0`` to print a report,
   waits that long: set ``aotgrad.capture.analyses.collectives.CHECK_TIMEOUT_S = 0``
   to turn the check off.) Ranks pair their
   captures by function name and count (the 3rd capture of ``f`` over ranks
   0, 1), as SPMD code makes them. Shapes are compared for the ops that
   require the same shape on every rank (not ``all_to_all_single``), and
   point-to-point ops (``isend``/``irecv``), which differ per rank by design,
   are left out of the comparison.

4. Only functional collectives. ``dist.all_reduce(t)`` and the other
   in-place collectives (``c10d.allreduce_``) write into their argument
   through a process-group object; capture refuses them
   (``UnsupportedOpError``, naming the functional collective to call instead)
   rather than record a graph that runs without them.

5. No silent wrong gradient. A collective with no autograd formula in torch
   (``broadcast``) passes a gradient on as autograd's fallback does: with a
   warning that the result may be wrong. Capture turns that warning into a
   ``CollectiveGradError`` naming the op; ``detach()`` its input, or use the
   differentiable collectives.

Reports name collectives with their group: the seq table's op column and the
saved report's producer read ``op_text``, e.g.
``_c10d_functional.all_reduce.default [sum over group '0', ranks 0, 1]``.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import json
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from aotgrad._torch_compat import (
    NO_AUTOGRAD_KERNEL,
    OpOverload,
    default_store,
    resolve_process_group,
)
from aotgrad.errors import (
    CollectiveGradError,
    CollectiveMismatchError,
    UnsupportedOpError,
    UserFrame,
    format_error,
    user_frame_from_stack,
)
from aotgrad.ops.table import COLLECTIVE_NAMESPACES, is_collective, is_point_to_point, op_name

# node.meta key of a collective's CollectiveCall.
COLLECTIVE_KEY = "aotgrad_collective"
# How long the cross-rank check waits for another rank's sequence (Note [Collectives], rule 3);
# 0 turns the check off.
CHECK_TIMEOUT_S = 30.0
# Ops whose input must have the same shape on every rank of the group.
_SAME_SHAPE = frozenset(
    ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"]
)


class CollectiveCheckWarning(UserWarning):
    """The cross-rank check of collectives could not run (Note [Collectives], rule 3)."""


@dataclass(frozen=True, kw_only=True)
class CollectiveCall:
    """One collective as the ranks must agree on it (Note [Collectives]).

    >>> call = CollectiveCall(op="all_reduce", group="0", ranks=(0, 1), reduce_op="sum",
    ...                       shape=(4, 4), dtype="float32")
    >>> print(call)
    all_reduce(sum) over group '0' (ranks 0, 1) of float32[4, 4]
    >>> call.detail
    "sum over group '0', ranks 0, 1"
    """

    op: str  # the op's name without namespace and overload: "all_reduce"
    group: str  # the process group's name, as the graph holds it
    ranks: tuple[int, ...]  # the group's global ranks; () when it cannot be resolved
    reduce_op: str | None
    shape: tuple[int, ...]  # of the (first) tensor input
    dtype: str

    @property
    def detail(self) -> str:
        reduce = f"{self.reduce_op} " if self.reduce_op else ""
        ranks = ", ".join(map(str, self.ranks)) or "?"
        return f"{reduce}over group {self.group!r}, ranks {ranks}"

    def __str__(self) -> str:
        reduce = f"({self.reduce_op})" if self.reduce_op else ""
        ranks = ", ".join(map(str, self.ranks)) or "?"
        shape = ", ".join(map(str, self.shape))
        return (
            f"{self.op}{reduce} over group {self.group!r} (ranks {ranks}) of {self.dtype}[{shape}]"
        )

    def key(self) -> list[Any]:
        """What must be equal on every rank: the shape only where the op requires it."""
        shape = list(self.shape) if self.op in _SAME_SHAPE else None
        return [self.op, self.group, list(self.ranks), self.reduce_op, shape, self.dtype]


def describe_collectives(gm: fx.GraphModule) -> None:
    """Record each collective's :class:`CollectiveCall` on its node (``COLLECTIVE_KEY``)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_collective(node.target):
            call = _call_of(node)
            if call is not None:
                node.meta[COLLECTIVE_KEY] = call


def collective_calls(graph: fx.Graph) -> list[CollectiveCall]:
    """The collectives of ``graph`` in its order (waits aside)."""
    return [n.meta[COLLECTIVE_KEY] for n in graph.nodes if runs_collective(n)]


def op_text(node: fx.Node) -> str:
    """A node's op as reports show it; a collective (or its wait) with its group.

    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> op_text(g.call_function(torch.ops.aten.sin.default, (x,)))
    'aten.sin.default'
    """
    call = node.meta.get(COLLECTIVE_KEY)
    if call is None and node.op == "call_function" and is_collective(node.target) and node.args:
        source = node.args[0]  # a wait_tensor names the collective it waits for
        if isinstance(source, fx.Node) and COLLECTIVE_KEY in source.meta:
            return f"{op_name(node.target)} [of {source.meta[COLLECTIVE_KEY].op} {source.meta[COLLECTIVE_KEY].detail}]"
    return op_name(node.target) if call is None else f"{op_name(node.target)} [{call.detail}]"


def _call_of(node: fx.Node) -> CollectiveCall | None:
    """The collective ``node`` runs; None for waits and ops without a group (``wait_tensor``)."""
    op = node.target
    assert isinstance(op, OpOverload)
    bound: dict[str, Any] = {
        a.name: v for a, v in zip(op._schema.arguments, node.args, strict=False)
    }
    bound.update(node.kwargs)
    group = bound.get("group_name")
    if not isinstance(group, str):
        return None
    first = next((a for a in node.args if isinstance(a, fx.Node)), None)
    value = first.meta.get("val") if first is not None else None
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return CollectiveCall(
        op=op._schema.name.split("::")[-1],
        group=group,
        ranks=_group_ranks(group),
        reduce_op=bound.get("reduce_op") if isinstance(bound.get("reduce_op"), str) else None,
        shape=tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else (),
        dtype=str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else "",
    )


def _group_ranks(group: str) -> tuple[int, ...]:
    """The global ranks of the group named ``group``; () outside an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    try:
        return tuple(dist.get_process_group_ranks(resolve_process_group(group)))
    except (RuntimeError, ValueError, KeyError):
        return ()


def check_order(joint: fx.Graph, graphs: Sequence[fx.Graph | None]) -> None:
    """The collectives of ``graphs`` are the joint graph's, each once, in its order (rule 2).

    Raises AssertionError otherwise: the partitioner recomputed or reordered one (a bug).
    """
    order = {n.name: i for i, n in enumerate(joint.nodes) if runs_collective(n)}
    names = [n.name for g in graphs if g is not None for n in g.nodes if runs_collective(n)]
    positions = [order.get(name, -1) for name in names]
    if -1 in positions or positions != sorted(set(positions)):
        raise AssertionError(
            f"aotgrad bug: the graphs run the collectives {names}, not the joint graph's"
            f" {list(order)} once each in order (Note [Collectives]); please report it"
        )


def runs_collective(node: fx.Node) -> bool:
    """An op node that runs a collective (a saved result's placeholder keeps the meta only)."""
    return node.op == "call_function" and COLLECTIVE_KEY in node.meta


# Captures with collectives so far, by (function, ranks): pairs each rank's n-th capture.
_captures: collections.Counter[str] = collections.Counter()


def check_same_on_ranks(graph: fx.Graph, function: str, where: UserFrame | None) -> None:
    """Compare this graph's collectives with the other ranks' (Note [Collectives], rule 3).

    Raises :class:`CollectiveMismatchError` when another rank's sequence differs; warns
    (:class:`CollectiveCheckWarning`) when another rank publishes none in time.
    """
    calls = [c for n in graph.nodes if (c := _compared(n)) is not None]
    if not calls or CHECK_TIMEOUT_S <= 0 or not (dist.is_available() and dist.is_initialized()):
        return
    ranks = sorted({r for c in calls for r in c.ranks})
    me = dist.get_rank()
    if len(ranks) < 2 or me not in ranks:
        return
    prefix = f"aotgrad/collectives/{function}/{','.join(map(str, ranks))}"
    count = _captures[prefix]
    _captures[prefix] += 1
    store = default_store()
    store.set(f"{prefix}/{count}/{me}", json.dumps([asdict(c) for c in calls]))
    for peer in ranks:
        if peer != me:
            theirs = _published(store, f"{prefix}/{count}/{peer}", peer, function)
            if theirs is not None:
                _compare(calls, theirs, me, peer, function, where)


def _compared(node: fx.Node) -> CollectiveCall | None:
    call = node.meta.get(COLLECTIVE_KEY)
    return None if call is None or is_point_to_point(node.target) else call


def _published(store: Any, key: str, peer: int, function: str) -> list[CollectiveCall] | None:
    try:
        store.wait([key], datetime.timedelta(seconds=CHECK_TIMEOUT_S))
    except RuntimeError:  # DistStoreError: the peer published nothing in time
        warnings.warn(
            CollectiveCheckWarning(
                f"aotgrad could not compare the collectives of {function} with rank {peer}'s:"
                f" rank {peer} captured no such function within {CHECK_TIMEOUT_S:g} s"
                " (Note [Collectives]). If the ranks run different collectives, the first one"
                " that differs will hang."
            ),
            stacklevel=4,
        )
        return None
    raw = json.loads(store.get(key))
    return [
        CollectiveCall(**{**c, "ranks": tuple(c["ranks"]), "shape": tuple(c["shape"])}) for c in raw
    ]


def _compare(
    mine: Sequence[CollectiveCall],
    theirs: Sequence[CollectiveCall],
    me: int,
    peer: int,
    function: str,
    where: UserFrame | None,
) -> None:
    for i, (a, b) in enumerate(itertools.zip_longest(mine, theirs)):
        if a is None or b is None or a.key() != b.key():
            raise CollectiveMismatchError(
                format_error(
                    f"the ranks of {function} would run different collectives: collective"
                    f" #{i + 1} is {a or 'none'} on rank {me} but {b or 'none'} on rank"
                    f" {peer}. Every rank of a group must run the same collectives (op, group,"
                    " reduction, shape) in the same order, or they wait on each other forever",
                    where,
                    "Make every rank call the same collectives on the same process groups in"
                    " the same order (a group chosen per rank, or a collective under a"
                    " rank-dependent `if`, is the usual cause).",
                )
            )


# What to call instead of each in-place collective of ``torch.distributed``.
_FUNCTIONAL_FORM = {
    "allreduce_": "all_reduce(t, 'sum', group)",
    "allgather_": "all_gather_tensor(t, 0, group)",
    "_allgather_base_": "all_gather_tensor(t, 0, group)",
    "reduce_scatter_": "reduce_scatter_tensor(t, 'sum', 0, group)",
    "_reduce_scatter_base_": "reduce_scatter_tensor(t, 'sum', 0, group)",
    "broadcast_": "broadcast(t, src, group)",
}


def refuse_in_place_collective(op: object) -> None:
    """Raise for ``torch.distributed``'s in-place collectives (``dist.all_reduce(t)``).

    They write into their argument through a process group object and return a
    ``Work`` handle: a functional graph cannot hold them, and one that dropped or
    misplaced them would compute without them (Note [Collectives]).
    """
    if not (isinstance(op, OpOverload) and op.namespace == "c10d"):
        return
    name = op._schema.name.split("::")[-1]
    functional = _FUNCTIONAL_FORM.get(name, "the function of the same name")
    raise UnsupportedOpError(
        format_error(
            f"{op} is one of torch.distributed's in-place collectives (dist.all_reduce,"
            " dist.all_gather_into_tensor, ...): aotgrad's graphs hold only functional"
            " collectives",
            user_frame_from_stack(),
            f"Call torch.distributed._functional_collectives.{functional} instead (it returns"
            " a new tensor), or run the collective outside the compiled function.",
        )
    )


# Autograd's warning for a collective with no formula (only collectives' warnings become errors).
_NAMESPACES = "|".join(sorted(COLLECTIVE_NAMESPACES, key=len, reverse=True))
_NO_FORMULA = re.compile(rf"({_NAMESPACES})::(\w+): {NO_AUTOGRAD_KERNEL}")


@contextlib.contextmanager
def collective_grads_checked(where: UserFrame | None) -> Iterator[None]:
    """Around the backward: a gradient through a collective with no formula raises (rule 5)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=_NO_FORMULA.pattern, category=UserWarning)
        try:
            yield
        except UserWarning as e:
            found = _NO_FORMULA.match(str(e))
            if found is None:
                raise
            raise CollectiveGradError(
                format_error(
                    f"a gradient flows through {found[1]}.{found[2]}, a collective torch has no"
                    " gradient formula for: eager PyTorch would pass on a wrong gradient (with"
                    " a warning), so aotgrad refuses",
                    where,
                    "detach() the collective's input if no gradient should flow through it, or"
                    " use a differentiable collective (all_reduce with 'sum', all_gather_tensor,"
                    " reduce_scatter_tensor in torch.distributed._functional_collectives).",
                )
            ) from None


__all__ = [
    "CHECK_TIMEOUT_S",
    "COLLECTIVE_KEY",
    "CollectiveCall",
    "CollectiveCheckWarning",
    "check_order",
    "check_same_on_ranks",
    "collective_calls",
    "collective_grads_checked",
    "describe_collectives",
    "op_text",
    "refuse_in_place_collective",
    "runs_collective",
]
