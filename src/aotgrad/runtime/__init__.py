"""Stage 4: runtime. Compile both graphs and run them with ordinary autograd semantics.

Entry point: :func:`compile_partitioned`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotgrad._torch_compat import FUNCTION_BASE_APPLY, mark_boxed
from aotgrad.capture.analyses.autocast import autocast_off
from aotgrad.capture.analyses.input_aliases import graph_inputs
from aotgrad.partition import Partitioned
from aotgrad.partition.draws import Draws, lift_draws
from aotgrad.runtime.boxing import BoxedCall, Compiler, compile_boxed, make_boxed_func, nop
from aotgrad.runtime.function import Plan, direct_apply, make_function, run_epilogue
from aotgrad.runtime.higher_order import Driver, HigherOrder
from aotgrad.runtime.slices import num_forward_inputs
from aotgrad.runtime.straight_line import Step
from aotgrad.runtime.subclass_inputs import SubclassReplay
from aotgrad.runtime.transforms import refuse_transforms_on
from aotgrad.signature import Signature
from aotgrad.signature.subclasses import holds_flat_outputs, rebuild_outputs

__all__ = [
    "CompiledGraphs",
    "Driver",
    "HigherOrder",
    "Plan",
    "compile_graphs",
    "compile_partitioned",
    "higher_order_of",
    "make_boxed_func",
    "nop",
]


class CompiledGraphs:
    """One specialization, compiled: call it with the flat primals, get the user's result."""

    def __init__(
        self,
        partitioned: Partitioned | None,
        forward: Any,
        backward: Any | None,
        plan: Plan | None = None,
        higher_order: HigherOrder | None = None,
    ) -> None:
        # ``partitioned`` is None for graphs loaded from a file (``aotgrad.load``), which
        # bring their ``plan`` and hold no tensor subclass inputs.
        self.partitioned = partitioned
        if plan is None:
            assert partitioned is not None
            plan = Plan.of(partitioned)
        self.plan = plan
        # The compiled graphs, boxed calls as the compilers made them (a scan runs them).
        self.forward, self.backward = forward, backward
        # The create_graph backward (Note [Differentiable backward]); None for loaded graphs.
        self.higher_order = higher_order if backward else None
        self._function = (
            make_function(self.plan, forward, backward, self.higher_order) if backward else None
        )
        self._apply = direct_apply(self._function) if self._function else None
        self._bases = self.plan.input_bases
        self._unreached = _unreached_inputs(self.plan, partitioned) if self._function else ()
        # Tensor subclass inputs to take apart, subclass outputs to build (Note [Tensor
        # subclasses]).
        self._subclasses = None if partitioned is None else partitioned.joint.inputs.subclasses
        self._subclass_outputs = holds_flat_outputs(self.plan.out_spec)

    @property
    def takes_subclasses(self) -> bool:
        """Are some inputs tensor subclasses, taken apart at each call (Note [Tensor subclasses])?"""
        return self._subclasses is not None

    def direct_call(
        self, requires_grad: Sequence[bool] | None = None, common: bool = False
    ) -> Callable[[Sequence[torch.Tensor]], Any] | None:
        """``self.__call__`` for the common case, with nothing to rebuild around the Function.

        None unless the graphs need no input bases and every output is fresh
        (the epilogue's fast path, Note [What the autograd.Function returns]).
        ``requires_grad``: the inputs' ``requires_grad``, the same at every call (the
        caller's guard checks it). An input that does not require grad has no history to
        cut (Note [Inputs no gradient reaches]); graphs read from a file do not know which
        inputs required grad at the trace, and without it cut every input no gradient reaches.
        ``common=True``: the caller vouches for every call that grad mode is on, that
        no transform, forward-AD level or function mode is active (``common_state`` in
        ``cache/specializations.py``) and that the inputs passed a ``TensorGuards`` check against plain
        tensors (so none is a functorch wrapper, dead or alive): the Function's C++
        ``apply`` runs with none of ``direct_apply``'s checks (Note [Where a call's
        microseconds go]).
        """
        apply, plan = self._apply, self.plan
        if apply is None or self._bases or not plan.only_fresh or plan.has_sizes:
            return None
        if self._subclasses is not None or self._subclass_outputs:
            return None
        unreached = self._unreached
        if requires_grad is not None:
            unreached = tuple(i for i in unreached if requires_grad[i])
        if plan.made_to_require_grad or unreached:
            return None
        assert self._function is not None
        spec = plan.out_spec
        if common:
            raw = FUNCTION_BASE_APPLY.__get__(None, self._function)
            if spec.is_leaf():
                return lambda primals: raw(*primals)[0]
            return lambda primals: pytree.tree_unflatten(list(raw(*primals)), spec)
        if spec.is_leaf():
            return lambda primals: _apply_with_grad(apply, primals)[0]
        return lambda primals: pytree.tree_unflatten(list(_apply_with_grad(apply, primals)), spec)

    def failed_guard(self, primals: Sequence[torch.Tensor]) -> str | None:
        """The first shape guard these inputs fail, in the user's names; None when they pass."""
        guards = self.plan.guards
        if guards is None:
            return None
        inputs = graph_inputs(primals, self.plan.input_bases)
        return None if guards.check(inputs) else guards.failed(inputs) or "the shape guards"

    def __call__(self, primals: Sequence[torch.Tensor]) -> Any:
        refuse_transforms_on(primals)  # Note [Transforms run the function]
        if self._subclasses is None and not self._subclass_outputs:
            return self._call(primals)
        replay, outer = None, primals
        if self._subclasses is not None:  # Note [Tensor subclasses]
            if any(self._subclasses.changes):  # Note [Subclass inputs rebased]
                replay = SubclassReplay(self._subclasses, primals)
            primals = self._subclasses.take_apart(primals)
        # Note [Aliased subclass outputs]
        return rebuild_outputs(self._call(primals, replay), outer)

    def _call(self, primals: Sequence[torch.Tensor], replay: SubclassReplay | None = None) -> Any:
        for i in self.plan.made_to_require_grad:  # Note [requires_grad_() on an input]
            primals[i].requires_grad_(True)
        inputs = graph_inputs(primals, self._bases) if self._bases else primals
        if self._apply is None:
            with torch.no_grad(), autocast_off():  # Note [Autocast]
                results = self.forward(list(inputs))
            returned = [results[i] for i in self.plan.returned]
        elif self._unreached:  # Note [Inputs no gradient reaches]
            returned = _apply_with_grad(self._apply, _cut(inputs, self._unreached))
        else:
            returned = _apply_with_grad(self._apply, inputs)
        return run_epilogue(self.plan, primals, inputs, returned, replay)


# Note [Where a call's microseconds go]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A warm call of ``aot_function(f)(x, w)`` -- the last entry serves it and the
# graphs need nothing rebuilt around them (``direct_call``) -- runs three steps:
#
#     AOTFunction.__call__  no wrapper, no keyword arguments
#     cache.last_entry      grad mode and ``common_state()``: torch's default state,
#                           no capture, no transform (Note [The common state,
#                           checked fast]); the tensor guard (Note [The guard,
#                           written out]); the hit counted
#     the direct call       ``_FunctionBase.apply`` in C++, none of ``Function.apply``'s
#                           Python (Note [Calling the Function directly]): the
#                           node and ``ctx``, the Function's forward (the forward
#                           graph, ``save_for_backward``, the inputs a create_graph
#                           backward reads: Note [Primals in the backward]),
#                           the outputs wrapped
#
# The Function itself is most of the call, a little more than a bare
# ``Function.apply`` of the same graphs (it keeps ``w`` and its version for a
# create_graph backward, leaves missing cotangents as None: Note [Missing
# cotangents], checks autocast, returns a tuple). The guard is Dynamo's C++
# tensor check, then each tensor's storage offset, view flag and address.
# ``common_state`` reads torch's global state, each a setting some trace bakes
# in (Note [Torch settings in the key]), one generated expression for all. Each check stands for a
# field of the full key: dropping one would serve a call the full key sends
# elsewhere. What the call does not pay: the key itself (Note [The last
# entry]), ``Function.apply``'s Python layer (the bare floor pays it), the
# epilogue, and a dead functorch wrapper's unwrap (the C++ check refuses such
# a tensor: the full path unwraps it). ``python bench/overhead.py steps``
# measures each step; bench/findings.md has the breakdowns measured so far.
#
# ``aot_module(m)(x)`` cannot take the last entry: its key holds the module's
# state, which must be read afresh each call (Note [Reading a module, fast]).
# That read (``State.read``: every submodule's parameters, buffers, hook dicts
# and attributes, then the tensors' guard) is a large share of its call, and
# grows with the modules: Python's own loop over each ``__dict__`` (19 entries
# for a ``Linear``), ``named_modules``' generators and the attributes' keys
# (bench/findings.md, 2026-12-07).


# Note [Inputs no gradient reaches]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every graph input is an input of the autograd Function, so a non-leaf input
# that requires grad gets an autograd edge into the graph that made it, even
# when no output of this call reaches it (``reached_by`` 0: Note [Gradients no
# output reaches]). The backward returns None for it, but the engine still
# walks that edge, and if the other graph's backward already ran, raises
# "backward through the graph a second time", where eager, which never used
# the tensor, runs. The legacy ``weight_norm`` makes one every call: its
# pre-hook sets ``module.weight`` from the parameters, the previous call's
# weight is lifted as ``closure self.weight`` and overwritten before any read::
#
#     call 1: weight = W1 (an output of call 1's Function); loss1.backward()
#     call 2: inputs (..., W1, x) -> W1 unread; loss2.backward() walks W1's grad_fn
#
# So such inputs reach the Function detached (the same data, no edge), as
# fresh leaves that still require grad: an output can require grad in eager
# with no gradient reaching any input, and a Function none of whose inputs
# requires grad would return it without. A view made under ``no_grad`` of a
# non-leaf input requires grad with no ``grad_fn`` (Note [Views past a no_grad
# view]); what grad mode computes from it requires grad, with an edge to
# nowhere::
#
#     with torch.no_grad():          # x = leaf.unsqueeze(0): requires grad, a grad_fn
#         v = x[0]                   # requires grad, grad_fn None
#         with torch.enable_grad():
#             out = v.exp()          # eager: requires grad, ExpBackward0 -> (None, 0)
#
# The trace reads ``out`` requiring grad and no gradient reaching ``x``; the
# Function takes ``x`` cut, as a leaf that requires grad, so ``out`` requires
# grad, and its backward returns None for that leaf: nothing accumulates.


def _unreached_inputs(plan: Plan, partitioned: Partitioned | None) -> tuple[int, ...]:
    """Graph inputs that require grad, that no cotangent reaches and that the epilogue does
    not write (Note [Inputs no gradient reaches]); ``requires_grad`` is in every call's key."""
    written = {m.index for m in plan.mutations}
    needs = None if partitioned is None else partitioned.joint.requires_grad
    return tuple(
        i
        for i, mask in enumerate(plan.reached_by)
        if mask == 0 and i not in written and (needs is None or needs[i])
    )


def _cut(inputs: Sequence[torch.Tensor], positions: tuple[int, ...]) -> list[torch.Tensor]:
    """``inputs``, those at ``positions`` that have an autograd history cut off: fresh leaves
    that still require grad (Note [Inputs no gradient reaches])."""
    cut = list(inputs)
    reached = {id(t) for i, t in enumerate(inputs) if i not in positions}
    for i in positions:
        # A tensor also passed where a gradient reaches keeps its edge: its graph is walked
        # anyway, and the saved values may read it through this place (Note [A tensor passed
        # twice is not cut]).
        if cut[i].grad_fn is not None and id(cut[i]) not in reached:
            cut[i] = cut[i].detach().requires_grad_()
    return cut


# Note [A tensor passed twice is not cut]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tensor passed twice is one functional wrapper in the trace, and the graph
# may read it, and save it, through either placeholder: for ``f(a0, a1, a2)
# = a0 * a2`` called on ``(b, b, b[1:])`` (``b`` a non-leaf), the forward
# saves placeholder ``a1``, whose own gradient no output reaches. Cut there
# (Note [Inputs no gradient reaches]), the Function would save a fresh leaf,
# and the ``create_graph`` backward, differentiable in that saved primal
# (Note [Differentiable backward]), would send ``b``'s second-order term from
# ``a2``'s gradient into that leaf: silently lost (eager: ``b`` gets it). The
# reason to cut does not hold for such a place: the same tensor's graph is
# walked through its reached place anyway. So only a tensor passed nowhere a
# gradient reaches is cut.


# Note [Grad mode regions]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Grad mode inside the function is the function's business; the trace runs
# under the caller's mode and sees every ``no_grad``/``enable_grad``/
# ``set_grad_enabled``/``inference_mode`` region. Which outputs require grad
# is read off the traced outputs, so capture builds a backward whenever an
# input requires grad, even under the caller's ``no_grad``::
#
#     with torch.no_grad():
#         f(x)            # def f(x): with torch.enable_grad(): return x * 2
#
# The trace finds ``x * 2`` requires grad; the runtime calls its Function
# with grad mode on (under ``no_grad`` autograd would not record it), and
# the Function marks every output outside the region non-differentiable.
# An output rebuilt as a view (Note [Aliased outputs]) gets the trace's
# ``requires_grad`` too: ``v = a.view(-1); v.requires_grad_(True)`` on an
# input that does not require grad returns a view that does.
# A trace that stops partway (the direct trace, then the full one) starts the
# next one in the caller's mode, whatever region it stopped in (Notes [Each
# trace starts in the caller's grad mode], [Grad-mode regions in Dynamo's graph]).


def _apply_with_grad(apply: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Any:
    """Call the Function with grad mode on (Note [Grad mode regions]: under ``no_grad`` too)."""
    if torch.is_grad_enabled():
        return apply(*inputs)
    with torch.enable_grad():
        return apply(*inputs)


def compile_partitioned(
    partitioned: Partitioned,
    fw_compiler: Compiler | None,
    bw_compiler: Compiler | None,
    inference_compiler: Compiler | None,
    *,
    driver: Driver,
    draws_as_inputs: bool = False,
) -> CompiledGraphs:
    """Hand each graph to its compiler (``nop`` by default) and wire the results up.

    Compilers receive ``(gm, example_inputs)`` with fake example inputs. ``driver``
    captures the create_graph backward (``aotgrad.pipeline.compile_stage`` gives it);
    ``draws_as_inputs``: the compiled forward takes its random draws as inputs (Note [Random
    draws as inputs]).
    """
    forward, backward = compile_graphs(
        partitioned.forward,
        partitioned.backward,
        fw_compiler,
        bw_compiler,
        inference_compiler,
        draws_as_inputs=draws_as_inputs,
    )
    plan = Plan.of(partitioned)
    higher_order = None
    if partitioned.backward is not None:
        graphs = (partitioned.forward, partitioned.backward, partitioned.signature)
        higher_order = higher_order_of(*graphs, plan, driver)
    return CompiledGraphs(partitioned, forward, backward, plan, higher_order=higher_order)


def higher_order_of(
    forward: torch.fx.GraphModule | Sequence[Step],
    backward: torch.fx.GraphModule | None,
    signature: Signature | None,
    plan: Plan,
    driver: Driver,
    prepare: Callable[[], tuple[torch.fx.GraphModule, torch.fx.GraphModule, Signature]]
    | None = None,
) -> HigherOrder:
    """What computes a specialization's ``create_graph`` backward (Note [Differentiable backward]).

    Graphs read from a file give the forward's steps, no backward and no signature, and a
    ``prepare`` that builds them before ``G`` is first built.
    """
    changed = {m.index for m in plan.mutations} | set(plan.detached_inputs)
    if plan.input_bases:  # the graph inputs stand for several user inputs: keep none
        changed |= set(range(num_forward_inputs(forward)))
    return HigherOrder(
        forward=forward,
        backward=backward,
        signature=signature,
        saved_in_forward=plan.saved_in_forward,
        driver=driver,
        changed=frozenset(changed),
        set_inputs=frozenset(m.index for m in plan.mutations if m.storage is not None),
        prepare=prepare,
    )


def compile_graphs(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule | None,
    fw_compiler: Compiler | None = None,
    bw_compiler: Compiler | None = None,
    inference_compiler: Compiler | None = None,
    draws_as_inputs: bool = False,
) -> tuple[Any, Any | None]:
    """The forward and backward graphs, each handed to its compiler with its fake examples;
    with ``draws_as_inputs``, the forward's random draws are its last inputs, which the call
    draws with torch first (Note [Random draws as inputs])."""
    draws = None
    if draws_as_inputs:
        forward, draws = lift_draws(forward)
    fw = inference_compiler or fw_compiler if backward is None else fw_compiler
    compiled = compile_boxed(fw, forward, _examples(forward))
    if draws is not None:
        compiled = _drawing(compiled, draws)
    if backward is None:
        return compiled, None
    return compiled, compile_boxed(bw_compiler or fw_compiler, backward, _examples(backward))


def _drawing(forward: BoxedCall, draws: Draws) -> BoxedCall:
    """``forward``, called with its draws after the other inputs, made by torch now."""

    def call(args: list[Any]) -> Any:
        args.extend(draws())
        return forward(args)

    mark_boxed(call)
    return call


def _examples(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
