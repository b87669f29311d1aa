"""The calling convention of the forward and backward graphs, as data.

Note [Calling convention]
~~~~~~~~~~~~~~~~~~~~~~~~~
``forward(*inputs) -> (*outputs, *bases, *mutated, *saved)`` and
``backward(*saved, *cotangents) -> grads``.

- ``inputs``: every tensor the call reads, lifted state first (Note [Input
  order]): the traced module's own parameters, then its buffers; the tensors
  reached through closure cells, globals and defaults (Note [Closed-over
  tensors]); those of modules passed as arguments (Note [Module arguments]);
  last, the tensor leaves of the user's ``(args, kwargs)``. Inputs sharing
  memory may be replaced by one base (Note [Aliased inputs]), a tensor
  subclass input by its plain inner tensors (Note [Tensor subclasses]).
- ``outputs``: one per tensor leaf of the user's result, duplicates and views
  included, in pytree order (``Output``; ``MultiOutputView`` for a view made
  by ``unbind``, ``split`` or ``chunk``: Note [Multi-output views]); then one
  per tensor the function stored in the user's objects (``SideEffect``, Note
  [Side effects replayed]), which the runtime stores there again.
- ``bases``: intermediates that several outputs view (Note [Aliased outputs]).
- ``mutated``: new values of inputs the function mutated in place.
- ``saved``: what the backward needs, in the forward graph's order (so saved
  inputs come first); the backward receives them first, in the same order.
- ``cotangents``: one per differentiable output the autograd machinery sees.
- ``grads``: one per forward input, ``None`` for those that need no gradient.
- ``state``, ``new state`` (rare): inputs the backward changes in place (a
  BatchNorm's running statistics when a checkpointed region's recompute
  updates them again, or a tensor a custom Function's backward changes): the
  backward reads their values as they are when it runs (``StateAtBackward``,
  after the cotangents) and returns their new values (``MutatedInput``, after
  the grads), which the runtime writes into them (Note [State updated by the
  backward] in ``capture/analyses/backward_state.py``).

The joint graph is both graphs with nothing saved between them,
``joint(*inputs, *cotangents) -> (*outputs, *bases, *mutated, *grads)`` (and
any state last among its inputs, its new values last among its outputs); its
signature (``JointGraph.signature``) has no saved values.

Worked example: ``fn(x, w) = (x @ w).sin()`` with only ``w`` requiring grad.
The backward needs ``mm`` (for ``cos(mm)``) and ``x`` (for ``x.t() @ ...``);
``x`` is a placeholder, so it comes before ``mm``::

    forward(x, w)             -> (sin, x, mm)    # output; saved: x, mm
    backward(x, mm, cotangent) -> (None, grad_w)  # one grad per forward input

>>> import torch, aotgrad
>>> def fn(x, w):
...     return (x @ w).sin()
>>> sig = aotgrad.trace(fn, torch.randn(2, 3), torch.randn(3, 4, requires_grad=True)).signature
>>> print(sig)
Signature v1
  forward inputs:
    0: x
    1: w
  forward outputs:
    0: output
    1: saved: x
    2: saved: mm
  backward inputs:
    0: saved: x
    1: saved: mm
    2: cotangent of output
  backward outputs:
    0: None
    1: grad of w

Positions are the signature's business alone (Note [Positions]): a stage slices
a graph's values with the signature's queries and never counts them itself.

>>> sig.outputs_in_forward, sig.saved_in_forward
(slice(0, 1, None), slice(1, 3, None))
>>> sig.saved_in_backward, sig.cotangents_in_backward
(slice(0, 2, None), slice(2, 3, None))

A function that reads a global tensor and a global module, and takes a module
and a tensor: the user's two arguments come last, the module argument's
parameters before the tensor, the globals before both::

    forward(W, lin.weight, lin.bias, model.weight, model.bias, x)

>>> from torch import nn
>>> W, lin = torch.randn(3, 3, requires_grad=True), nn.Linear(3, 3)
>>> def step(model, x):
...     return (model(x) @ W + lin(x)).sum()
>>> sig = aotgrad.trace(step, nn.Linear(3, 3), torch.randn(2, 3)).signature
>>> [str(d) for d in sig.forward_inputs]
['global W', 'global lin.weight', 'global lin.bias', 'model.weight', 'model.bias', 'x']

``docs/calling-convention.md`` is the user-facing statement of this Note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aotgrad.signature.descriptors import (
    Cotangent,
    Descriptor,
    Grad,
    GraphInputDescriptor,
    MultiOutputView,
    MutatedInput,
    Output,
    OutputBase,
    Saved,
    SideEffect,
    StateAtBackward,
)

SIGNATURE_VERSION = 1


@dataclass(frozen=True)
class Signature:
    """Every placeholder and output of the forward and backward graphs, described."""

    # Forward placeholders: the lifted tensors (module state, closed-over tensors, module
    # arguments' state), then the user's tensor leaves (Note [Input order]); inputs sharing
    # memory may be replaced by one InputBase (Note [Aliased inputs]).
    forward_inputs: tuple[GraphInputDescriptor, ...]
    # Forward outputs, in order: Output..., OutputBase..., MutatedInput..., Saved...
    forward_outputs: tuple[Descriptor, ...]
    # Backward placeholders, in order: Saved..., Cotangent..., StateAtBackward...
    backward_inputs: tuple[Saved | Cotangent | StateAtBackward, ...]
    # Backward outputs: one per forward input (None where that input needs no gradient),
    # then the new value of each StateAtBackward, in the same order.
    backward_outputs: tuple[Grad | MutatedInput | None, ...]
    # Version of this convention's layout: the kinds of descriptor each group holds and
    # their order (``to_dict`` carries it). A change of that layout is to bump it.
    version: int = field(default=SIGNATURE_VERSION)

    def __post_init__(self) -> None:
        _check_order("forward outputs", self.forward_outputs, _FORWARD_ORDER)
        _check_order("backward inputs", self.backward_inputs, _BACKWARD_ORDER)
        if self.saved != tuple(d for d in self.backward_inputs if isinstance(d, Saved)):
            raise AssertionError(
                f"expected the backward to receive the saved values {self.saved} in order,"
                f" got {self.backward_inputs}"
            )
        grads = self.backward_outputs[: len(self.forward_inputs)]
        new_state = self.backward_outputs[len(self.forward_inputs) :]
        state = tuple(MutatedInput(of=d.of) for d in self.state_at_backward)
        if len(grads) != len(self.forward_inputs) or any(
            isinstance(g, MutatedInput) for g in grads
        ):
            raise AssertionError(f"expected {len(self.forward_inputs)} grads, got {grads}")
        if new_state != state:
            raise AssertionError(f"expected the backward to return {state} last, got {new_state}")

    @property
    def outputs(self) -> tuple[Output, ...]:
        return tuple(d for d in self.forward_outputs if isinstance(d, Output))

    @property
    def saved(self) -> tuple[Saved, ...]:
        return tuple(d for d in self.forward_outputs if isinstance(d, Saved))

    @property
    def cotangents(self) -> tuple[Cotangent, ...]:
        return tuple(d for d in self.backward_inputs if isinstance(d, Cotangent))

    @property
    def state_at_backward(self) -> tuple[StateAtBackward, ...]:
        """Inputs the backward reads and updates (Note [State updated by the backward])."""
        return tuple(d for d in self.backward_inputs if isinstance(d, StateAtBackward))

    @property
    def has_backward(self) -> bool:
        """Is there a backward graph? Exactly when some forward output gets a cotangent."""
        return bool(self.cotangents)

    # Note [Positions]
    # ~~~~~~~~~~~~~~~~
    # Each group of the convention sits in one contiguous run of its graph's
    # inputs or outputs (``__post_init__`` checks the order), so every position
    # query is a ``slice``: ``values[sig.saved_in_forward]`` are the saved values
    # of a forward call. An empty group is an empty slice where it would sit.
    # For this function, with ``x`` requiring grad (``tests/test_convention.py``
    # checks every slice below)::
    #
    #     def f(x, buf):
    #         buf.add_(1)
    #         t = x.exp()
    #         return x.sin(), t[0], t[1]
    #
    #     forward outputs:  0 output[0]   1 output[1]   2 output[2]
    #                       3 base of output[1], output[2]
    #                       4 new value of buf
    #                       5 saved: x    6 saved: exp
    #     outputs_in_forward = slice(0, 3)   bases_in_forward   = slice(3, 4)
    #     mutated_in_forward = slice(4, 5)   saved_in_forward   = slice(5, 7)
    #     results_in_forward = slice(0, 5)   # all but the saved: what the caller sees
    #     backward inputs:  0 saved: x    1 saved: exp
    #                       2 cotangent of output[0]   3 cotangent of base of ...
    #     saved_in_backward  = slice(0, 2)   cotangents_in_backward = slice(2, 4)
    #     grads_in_joint     = slice(5, 7)   # joint outputs: the results, then the grads

    @property
    def outputs_in_forward(self) -> slice:
        """Where the user's tensor outputs sit among the forward outputs (Note [Positions])."""
        return _span(self.forward_outputs, _FORWARD_ORDER, Output)

    @property
    def bases_in_forward(self) -> slice:
        """Where the output bases sit among the forward outputs (Note [Positions])."""
        return _span(self.forward_outputs, _FORWARD_ORDER, OutputBase)

    @property
    def mutated_in_forward(self) -> slice:
        """Where mutated inputs' new values sit among the forward outputs (Note [Positions])."""
        return _span(self.forward_outputs, _FORWARD_ORDER, MutatedInput)

    @property
    def saved_in_forward(self) -> slice:
        """Where the saved values sit among the forward outputs: last (Note [Positions])."""
        return _span(self.forward_outputs, _FORWARD_ORDER, Saved)

    @property
    def results_in_forward(self) -> slice:
        """Outputs, bases and mutated: the forward outputs before the saved values.

        Its ``stop`` is how many forward results precede the saved values.

        >>> from aotgrad.signature import Input, Output, Saved
        >>> sig = Signature(
        ...     forward_inputs=(Input(path="x"),),
        ...     forward_outputs=(Output(path=""), Saved(name="x")),
        ...     backward_inputs=(Saved(name="x"), Cotangent(of=Output(path=""))),
        ...     backward_outputs=(Grad(of=Input(path="x")),),
        ... )
        >>> sig.results_in_forward, sig.saved_in_forward
        (slice(0, 1, None), slice(1, 2, None))
        """
        return slice(0, self.saved_in_forward.start)

    @property
    def saved_in_backward(self) -> slice:
        """Where the saved values sit among the backward inputs: first (Note [Positions])."""
        return _span(self.backward_inputs, _BACKWARD_ORDER, Saved)

    @property
    def cotangents_in_backward(self) -> slice:
        """Where the cotangents sit among the backward inputs: last (Note [Positions])."""
        return _span(self.backward_inputs, _BACKWARD_ORDER, Cotangent)

    @property
    def state_in_backward(self) -> slice:
        """Where the inputs' values at backward time sit among the backward inputs: after the
        cotangents (Note [State updated by the backward])."""
        return _span(self.backward_inputs, _BACKWARD_ORDER, StateAtBackward)

    @property
    def grads_in_backward(self) -> slice:
        """Where the grads sit among the backward outputs: first, one per forward input."""
        return slice(0, len(self.forward_inputs))

    @property
    def new_state_in_backward(self) -> slice:
        """Where the new values of the ``StateAtBackward`` inputs sit among the backward
        outputs: after the grads."""
        return slice(len(self.forward_inputs), len(self.backward_outputs))

    @property
    def grads_in_joint(self) -> slice:
        """Where the grads sit among the joint graph's outputs, after the forward results.

        Only a signature without saved values describes a joint graph (Note
        [Calling convention]); a joint graph without a backward has no grads.
        """
        if self.saved:
            raise AssertionError(f"expected the joint graph's signature (none saved), got {self}")
        start = len(self.forward_outputs)
        return slice(start, start + len(self.forward_inputs) if self.has_backward else start)

    @property
    def new_state_in_joint(self) -> slice:
        """Where the backward's new state values sit among the joint graph's outputs: last."""
        start = self.grads_in_joint.stop
        return slice(start, start + len(self.state_at_backward))

    @property
    def cotangents_in_joint(self) -> slice:
        """Where the cotangents sit among the joint graph's inputs, after the primals.

        >>> from aotgrad.signature import Input, Output
        >>> joint = Signature(
        ...     forward_inputs=(Input(path="x"), Input(path="w")),
        ...     forward_outputs=(Output(path=""),),
        ...     backward_inputs=(Cotangent(of=Output(path="")),),
        ...     backward_outputs=(None, Grad(of=Input(path="w"))),
        ... )
        >>> joint.cotangents_in_joint, joint.grads_in_joint
        (slice(2, 3, None), slice(1, 3, None))
        """
        if self.saved:
            raise AssertionError(f"expected the joint graph's signature (none saved), got {self}")
        start = len(self.forward_inputs)
        return slice(start, start + len(self.cotangents))

    @property
    def state_in_joint(self) -> slice:
        """Where the ``StateAtBackward`` placeholders sit among the joint graph's inputs: last."""
        start = self.cotangents_in_joint.stop
        return slice(start, start + len(self.state_at_backward))

    def with_saved(self, saved: tuple[Saved, ...]) -> Signature:
        """The convention of the forward and backward graphs split from a joint graph.

        ``saved`` go last among the forward outputs and first among the backward inputs.

        >>> from aotgrad.signature import Input, Output
        >>> joint = Signature(
        ...     forward_inputs=(Input(path="x"),),
        ...     forward_outputs=(Output(path=""),),
        ...     backward_inputs=(Cotangent(of=Output(path="")),),
        ...     backward_outputs=(Grad(of=Input(path="x")),),
        ... )
        >>> [str(d) for d in joint.with_saved((Saved(name="cos"),)).backward_inputs]
        ['saved: cos', 'cotangent of output']
        """
        if self.saved:
            raise AssertionError(f"expected a signature with nothing saved yet, got {self}")
        return Signature(
            forward_inputs=self.forward_inputs,
            forward_outputs=(*self.forward_outputs, *saved),
            backward_inputs=(*saved, *self.backward_inputs),
            backward_outputs=self.backward_outputs,
            version=self.version,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the layout is versioned by ``version``."""
        out: dict[str, Any] = {"version": self.version}
        for name in _GROUPS:
            out[name] = [None if d is None else d.to_dict() for d in getattr(self, name)]
        return out

    def __str__(self) -> str:
        lines = [f"Signature v{self.version}"]
        for name in _GROUPS:
            lines.append(f"  {name.replace('_', ' ')}:")
            lines += [f"    {i}: {d}" for i, d in enumerate(getattr(self, name))]
        return "\n".join(lines)


# The four groups of descriptors, in the order they print.
_GROUPS = ("forward_inputs", "forward_outputs", "backward_inputs", "backward_outputs")


# The rank of each kind of descriptor in its graph's inputs or outputs.
# A SideEffect is an output stored in the user's objects (Note [Side effects replayed]); a
# MultiOutputView an output that keeps eager's rule for views of unbind (Note [Multi-output views]).
_FORWARD_ORDER: dict[type, int] = {
    Output: 0,
    MultiOutputView: 0,
    SideEffect: 0,
    OutputBase: 1,
    MutatedInput: 2,
    Saved: 3,
}
_BACKWARD_ORDER: dict[type, int] = {Saved: 0, Cotangent: 1, StateAtBackward: 2}


def _check_order(what: str, descriptors: tuple[Descriptor, ...], order: dict[type, int]) -> None:
    kinds = [order.get(type(d), -1) for d in descriptors]
    if -1 in kinds or kinds != sorted(kinds):
        expected = ", ".join(f"{kind.__name__}..." for kind in order)
        raise AssertionError(f"expected {what} in the order {expected}, got {descriptors}")


def _span(descriptors: tuple[Descriptor, ...], order: dict[type, int], kind: type) -> slice:
    """Where the descriptors of ``kind`` sit: after every earlier kind (Note [Positions])."""
    start = sum(1 for d in descriptors if order[type(d)] < order[kind])
    return slice(start, start + sum(1 for d in descriptors if order[type(d)] == order[kind]))
