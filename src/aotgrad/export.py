"""The forward and backward graphs as ``torch.export`` programs, the door backends take.

:func:`export_graphs` turns a :class:`~aotgrad.partition.Partitioned` and the real tensors
lifted from the module into two ``torch.export.ExportedProgram`` s whose graph signatures
name every input and output in ``torch.export``'s own vocabulary (Note [Export signatures]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import ExportedProgram, ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from aotgrad._torch_compat import OpOverload
from aotgrad.capture.provenance import NodeInfo
from aotgrad.capture.tracing.decompose import decompose_graph
from aotgrad.errors import CallError, ConfigError
from aotgrad.ops.core_aten import (
    check_decomposition_set,
    decomposition_set,
    non_core_nodes,
    refuse_non_core,
)
from aotgrad.partition import Partitioned
from aotgrad.partition.draws import Draws, lift_draws
from aotgrad.partition.sizes import is_static
from aotgrad.signature.descriptors import (
    Buffer,
    Closure,
    Cotangent,
    Descriptor,
    Draw,
    Global,
    Grad,
    Input,
    InputBase,
    MutatedInput,
    Output,
    OutputBase,
    Param,
    Saved,
)

__all__ = ["RANDOM_CHOICES", "ExportedGraphs", "export_graphs"]

# Note [Export signatures]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# aotgrad's descriptors map onto ``torch.export``'s input and output kinds:
#
#   forward inputs     Param(fc.weight)      -> InputKind.PARAMETER, target "fc.weight"
#                      Buffer(bn.running_mean) -> InputKind.BUFFER, target "bn.running_mean"
#                      Input(x), InputBase   -> InputKind.USER_INPUT
#                      Closure(w), Global(W) -> InputKind.CONSTANT_TENSOR, target
#                      "aotgrad_w" (the placeholder's name), in ``constants``
#                      Draw(bernoulli)       -> InputKind.USER_INPUT, after the user's
#                      inputs (Note [Random draws as inputs])
#   forward outputs    MutatedInput(of=Buffer) -> OutputKind.BUFFER_MUTATION (and of a Param,
#                      PARAMETER_MUTATION; of an Input, USER_INPUT_MUTATION)
#                      Output, OutputBase, Saved -> OutputKind.USER_OUTPUT
#   backward inputs    Saved, Cotangent      -> InputKind.USER_INPUT
#   backward outputs   Grad(of=Input, InputBase, Closure or Global) -> OutputKind.USER_OUTPUT,
#                      first
#                      Grad(of=Param)        -> OutputKind.GRADIENT_TO_PARAMETER, target
#                      "fc.weight"
#
# The gradient of a user input is a USER_OUTPUT, not GRADIENT_TO_USER_INPUT: that kind's
# target must be a placeholder of the same graph (``torch.export.save`` renames it through
# the graph's own node names, and fails on a name it lacks), and the user input is a
# placeholder of the forward program only. ``ExportedGraphs.backward_outputs`` and the node's
# ``meta["aotgrad"]["output"]`` say which input each one is the gradient of. In the joint
# program (``export(joint=True)``: the forward's inputs, then the cotangents as USER_INPUTs),
# the input is a placeholder of the same graph, and its gradient is GRADIENT_TO_USER_INPUT.
#
# ``torch.export`` wants the mutations first among the outputs, then the user outputs, then
# the gradients (GRADIENT_TO_*), so the forward program's
# outputs are aotgrad's reordered: for ConvBN, aotgrad's forward returns
# ``(loss, new running_mean, new running_var, new num_batches_tracked, *saved)``; the program
# returns the three mutations, then ``(loss, *saved)`` as its user outputs, and its
# ``.module()`` writes the mutations into its buffers. A backward output that is ``None`` (no
# gradient: a buffer, an integer input) is left out of the backward program. Every node keeps
# aotgrad's provenance as plain data: ``node.meta["aotgrad"]`` (``seq_nr``, module, source,
# and the descriptor of a placeholder or output), copied to ``node.meta["custom"]["aotgrad"]``,
# the one place ``torch.export.save`` keeps user metadata.
#
# ``export(flat=True)`` gives the form of a pure function, the one backends that compile a
# function of tensors take (``torch.onnx.export`` keeps only USER_INPUTs and USER_OUTPUTs and
# drops mutations and gradients of parameters; IREE's FX importer takes any): the same graphs
# and the same order, with every input a USER_INPUT and every output a USER_OUTPUT, and
# ``ExportedGraphs.lifted`` holding the tensors to pass first. For ConvBN::
#
#     lifted:   forward.module()(*params, *buffers, x) -> (new running_mean, new running_var,
#               new num_batches_tracked, loss, *saved)
#     flat:     forward_inputs  (Param(conv.weight), ..., Buffer(bn.running_mean), ..., Input(x))
#               forward_outputs (MutatedInput(of=Buffer(bn.running_mean)), ..., Output, *Saved)
#
# A tensor made at capture (``_tensor_constant0``) stays a CONSTANT_TENSOR: it is part of
# the function, not an argument of it.
#
# Anything else (a tensor subclass's inner tensor, a mutated closed-over tensor, a graph
# writing its mutations itself, a gradient of a buffer, symbolic sizes, a function that
# read the whole environment at capture) raises ``CallError``: a program whose
# signature misnames a value would run wrong in a backend without a word.


@dataclass(frozen=True)
class ExportedGraphs:
    """The forward and backward graphs of one specialization as ``torch.export`` programs."""

    # (*params, *buffers, *user inputs) -> (*mutations, *outputs, *saved); run
    # ``forward.module()(*user inputs)``.
    forward: ExportedProgram
    # (*saved, *cotangents) -> (*grads of user inputs, *grads of parameters), None ones left
    # out; None without a backward.
    backward: ExportedProgram | None
    # What each user output of ``forward.module()`` is, in order: ``Output``, ``OutputBase``,
    # then ``Saved`` (the backward's leading inputs). An output aotgrad's runtime returns
    # without the graph (an input returned as it is) is not among them.
    forward_outputs: tuple[Descriptor, ...] = ()
    # What each input of ``backward.module()`` is: ``Saved``, then ``Cotangent``.
    backward_inputs: tuple[Saved | Cotangent, ...] = ()
    # What each output of ``backward.module()`` is: a ``Grad`` (None ones left out), the
    # gradients of user inputs first, then those of parameters.
    backward_outputs: tuple[Grad, ...] = ()
    # With ``export(joint=True)``: the joint graph, (*params, *buffers, *closed-over, *user
    # inputs, *cotangents) -> (*mutations, *outputs, *grads); and what each output of
    # ``joint.module()`` is.
    joint: ExportedProgram | None = None
    joint_outputs: tuple[Descriptor, ...] = ()
    # What each input of ``forward.module()`` is, in order: the user inputs; with
    # ``export(flat=True)``, the lifted tensors' descriptors (Param, Buffer, Closure,
    # Global) first.
    forward_inputs: tuple[Descriptor, ...] = ()
    # With ``export(flat=True)``: the tensors to pass first to ``forward.module()`` (and to
    # ``joint.module()``), one per leading ``forward_inputs`` descriptor; () otherwise.
    lifted: tuple[torch.Tensor, ...] = ()
    # Whether every program takes its parameters and buffers as inputs and returns its
    # mutations and gradients as outputs (Note [Export signatures]).
    flat: bool = False
    # The environment variables the function read at capture, with the value each read saw
    # (None: unset): the programs hold what it did with these values, as the graphs do
    # (Note [Environment read at capture]); transformers' Llama reads one.
    environment: tuple[tuple[str, str | None], ...] = ()
    # With random draws as inputs (Note [Random draws as inputs]): () -> (*draws,), one per
    # ``Draw`` of ``forward_inputs`` (the last ones), in order; :meth:`draw` runs it.
    draws: ExportedProgram | None = None

    def draw(self) -> tuple[torch.Tensor, ...]:
        """The forward's random draws, made by torch's default generator as eager makes them:
        pass them after the other inputs of ``forward.module()`` (and of ``joint.module()``).
        Call it once per step, before the forward, and a step under ``torch.manual_seed(s)``
        uses eager's masks; () when the programs draw nothing.

        >>> import torch, aotgrad
        >>> drop = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        >>> programs = aotgrad.trace(drop, torch.ones(2, 4)).export(decompositions="core_aten")
        >>> [str(d) for d in programs.forward_inputs]
        ['input', 'draw bernoulli: aten.bernoulli.p in 1']
        >>> _ = torch.manual_seed(0); out = programs.forward.module()(torch.ones(2, 4), *programs.draw())
        >>> _ = torch.manual_seed(0); torch.equal(out[0], drop(torch.ones(2, 4)))
        True
        """
        if self._draw_module is None:
            return ()
        with torch.no_grad():
            return tuple(self._draw_module())

    @cached_property
    def _draw_module(self) -> torch.nn.Module | None:
        return None if self.draws is None else self.draws.module()

    def __post_init__(self) -> None:
        n_draws = sum(isinstance(d, Draw) for d in self.forward_inputs)
        if self.draws is not None and n_draws != len(self.draws.graph_signature.user_outputs):
            raise AssertionError(f"expected one draw per Draw input ({n_draws}) in the program")
        user = self.forward.graph_signature.user_outputs
        if len(user) != len(self.forward_outputs):
            raise AssertionError(
                f"expected one descriptor per forward user output ({len(user)}),"
                f" got {len(self.forward_outputs)}"
            )
        if self.joint is not None:
            mutations = {OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION}
            mutations.add(OutputKind.USER_INPUT_MUTATION)
            specs = self.joint.graph_signature.output_specs
            n_returned = sum(s.kind not in mutations for s in specs)
            if n_returned != len(self.joint_outputs):
                raise AssertionError(
                    f"expected one descriptor per joint output ({n_returned}),"
                    f" got {len(self.joint_outputs)}"
                )
        if self.backward is not None:
            n_in = len(self.backward.graph_signature.user_inputs)
            n_out = len(self.backward.graph_signature.output_specs)
            if (n_in, n_out) != (len(self.backward_inputs), len(self.backward_outputs)):
                raise AssertionError(
                    f"expected {n_in} backward input and {n_out} output descriptors, got"
                    f" {len(self.backward_inputs)} and {len(self.backward_outputs)}"
                )


# What ``export(decompositions=...)`` takes: a set's name, or a dict from op to function.
ExportDecompositions = str | Mapping[Any, Callable[..., Any]] | None
# What ``export(random=...)`` takes: random ops kept in the programs, or their draws made
# inputs (Note [Random draws as inputs]); None: inputs for flat programs and Core ATen.
RANDOM_CHOICES = ("ops", "inputs")


def export_graphs(
    partitioned: Partitioned,
    lifted: Sequence[torch.Tensor],
    joint: bool = False,
    flat: bool = False,
    decompositions: ExportDecompositions = None,
    random: str | None = None,
) -> ExportedGraphs:
    """``partitioned``'s graphs as programs; ``lifted``: the real tensors of its leading
    Param/Buffer/Closure/Global inputs, in order; ``joint``: the joint graph too; ``flat``:
    every input a USER_INPUT, every output a USER_OUTPUT (Note [Export signatures]);
    ``decompositions``: every program decomposed with that table, and with a set's name,
    holding only its ops (Note [Decomposing a captured graph]); ``random``: ``"inputs"``,
    the forward's draws made inputs and a draw program (Note [Random draws as inputs]),
    ``"ops"``, random ops kept; None, inputs when ``flat`` or a set's name is given."""
    if random is not None and random not in RANDOM_CHOICES:
        raise ConfigError(
            f"export(random={random!r}) takes None, 'ops' (random ops kept in the programs: only"
            " torch draws eager's numbers) or 'inputs' (the draws made inputs, drawn by"
            " ExportedGraphs.draw())"
        )
    as_inputs = random == "inputs" or (random is None and (flat or isinstance(decompositions, str)))
    if partitioned.mutations_in_graph:
        raise CallError(
            "this trace has no backward and its forward graph writes its input mutations"
            " itself; export takes graphs that return the new values. Trace with an input"
            " that requires grad to export it"
        )
    environ = partitioned.joint.environ
    if environ is not None and environ.whole is not None:  # Note [Environment read at capture]
        raise CallError(
            "the function read the whole environment at capture (iterated or copied"
            " os.environ), and its graphs may hold what any variable said; export names the"
            " variables a program assumes one by one. Read the variables you need by name"
            " (os.environ.get) to export the graphs"
        )
    signature = partitioned.signature
    if signature.state_at_backward:  # Note [State updated by the backward]
        named = ", ".join(str(d.of) for d in signature.state_at_backward[:3])
        function = next((r.what for r in partitioned.joint.state_regions if r.what), None)
        why, todo = (
            (f"{function} changes it in place", "Make the change outside the compiled function")
            if function is not None
            else (
                "a checkpointed region updates that state again when the backward recomputes"
                " it (a BatchNorm's running statistics)",
                "Turn gradient checkpointing off, or put the BatchNorm in eval mode,",
            )
        )
        raise CallError(
            f"the backward reads and updates {named}: {why}, and an exported program's calling"
            f" convention has no place for state the backward mutates. {todo} to export the"
            " graphs"
        )
    forward_gm, draws = partitioned.forward, None
    joint_gm = partitioned.joint.gm if joint else None
    if as_inputs:
        forward_gm, draws = lift_draws(forward_gm)
        joint_gm = _joint_draws(joint_gm, draws)
    graphs = (forward_gm, partitioned.backward, joint_gm)
    forward_gm, backward_gm, joint_gm = _decomposed(graphs, decompositions)
    drawn = () if draws is None else draws.descriptors
    forward, forward_outputs = _graph_program(
        forward_gm, (*signature.forward_inputs, *drawn), signature.forward_outputs, lifted, flat
    )
    backward: ExportedProgram | None = None
    grads: tuple[Descriptor, ...] = ()
    if backward_gm is not None:
        backward, grads = _graph_program(
            backward_gm, signature.backward_inputs, signature.backward_outputs, (), flat
        )
    joint_program: ExportedProgram | None = None
    joint_outputs: tuple[Descriptor, ...] = ()
    if joint_gm is not None:
        graph = partitioned.joint
        joint_inputs = (*graph.graph_inputs, *graph.cotangents, *drawn)
        results = tuple(joint_gm.graph.output_node().meta["desc"])
        joint_program, joint_outputs = _graph_program(joint_gm, joint_inputs, results, lifted, flat)
    return ExportedGraphs(
        forward=forward,
        backward=backward,
        forward_outputs=forward_outputs,
        backward_inputs=tuple(
            d for d in signature.backward_inputs if isinstance(d, Saved | Cotangent)
        )
        if backward is not None
        else (),
        backward_outputs=tuple(g for g in grads if isinstance(g, Grad)),
        joint=joint_program,
        joint_outputs=joint_outputs,
        forward_inputs=tuple(
            d
            for d in (*signature.forward_inputs, *drawn)
            if flat or isinstance(d, Input | InputBase | Draw)
        ),
        lifted=tuple(t.detach() for t in lifted) if flat else (),
        flat=flat,
        environment=() if environ is None else environ.values,
        draws=None if draws is None else _draw_program(draws),
    )


def _joint_draws(joint: fx.GraphModule | None, draws: Draws | None) -> fx.GraphModule | None:
    """The joint graph with the forward's draws as its last inputs: the same draws, as the
    joint holds the forward's random ops (a recompute's are linked to them)."""
    if joint is None or draws is None:
        return joint
    lifted, joint_draws = lift_draws(joint)
    names = None if joint_draws is None else joint_draws.descriptors
    if names != draws.descriptors:
        raise AssertionError(
            f"expected the joint graph to draw what the forward draws, {draws.descriptors},"
            f" got {names}"
        )
    return lifted


def _draw_program(draws: Draws) -> ExportedProgram:
    """The draw program as a program of no inputs returning the draws."""
    graph, placeholders, outputs = _copy(draws.program)
    if placeholders:
        raise AssertionError(f"expected a draw program without inputs, got {placeholders}")
    constants: dict[str, torch.Tensor] = {}
    inputs = _lift_constants(draws.program, graph, constants)
    specs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outputs if o]
    for node, desc in zip(outputs, draws.descriptors, strict=True):
        if node is not None:
            _annotate(node, desc, output=True)
    return _program(graph, inputs, specs, {}, 0, len(specs), constants)


_Graphs = tuple[fx.GraphModule, fx.GraphModule | None, fx.GraphModule | None]


def _decomposed(graphs: _Graphs, decompositions: ExportDecompositions) -> _Graphs:
    """The forward, backward and joint graph decomposed with ``decompositions``' table, each
    only if it holds an op the table changes: a trace captured with the same set is exported
    as it is (Note [Decomposing a captured graph]). With a set's name, every op of the result
    is in the set, or an UnsupportedOpError names the ones that are not."""
    if decompositions is None:
        return graphs
    name: str | None = None
    if isinstance(decompositions, str):
        name = check_decomposition_set(decompositions)
        table = decomposition_set(name)
    elif isinstance(decompositions, Mapping) and all(
        isinstance(op, OpOverload) and callable(fn) for op, fn in decompositions.items()
    ):
        table = decompositions
    else:
        raise ConfigError(
            f"export(decompositions={decompositions!r}) takes None, 'core_aten' (PyTorch's Core"
            " ATen opset) or a dict from OpOverload (torch.ops.aten.silu.default, not"
            " torch.ops.aten.silu) to function"
        )

    def decomposed(gm: fx.GraphModule | None) -> fx.GraphModule | None:
        if gm is None:
            return None
        ops = [n for n in gm.graph.nodes if n.op == "call_function"]
        if name is not None:
            needed = bool(non_core_nodes(gm.graph))
        else:
            needed = any(n.target in table for n in ops)
        if not needed:
            return gm
        _check_static(gm.graph.find_nodes(op="placeholder"))
        result = decompose_graph(gm, table)
        if name is not None:
            refuse_non_core(result.graph, name, exporting=True)
        return result

    forward, backward, joint = (decomposed(gm) for gm in graphs)
    if forward is None:
        raise AssertionError("expected a forward graph, got None")
    return forward, backward, joint


# The graph inputs export names; anything else is refused (Note [Export signatures]).
_INPUTS = (Param, Buffer, Closure, Global, Input, InputBase, Saved, Cotangent, Draw)


def _graph_program(
    gm: fx.GraphModule,
    input_descs: Sequence[Descriptor],
    output_descs: Sequence[Descriptor | None],
    lifted: Sequence[torch.Tensor],
    flat: bool,
) -> tuple[ExportedProgram, tuple[Descriptor, ...]]:
    """One graph as a program, and the descriptors of its ``module()``'s outputs, in order
    (Note [Export signatures]); ``flat``: every input and output the user's."""
    graph, placeholders, outputs = _copy(gm)
    _check_count("inputs", placeholders, input_descs)
    _check_count("outputs", outputs, output_descs)
    state: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    inputs: list[InputSpec] = []
    names: dict[Descriptor, str] = {}
    for i, (node, desc) in enumerate(zip(placeholders, input_descs, strict=True)):
        _annotate(node, desc)
        names[desc] = node.name
        if not isinstance(desc, _INPUTS):
            raise _unsupported(desc, "graph input")
        is_lifted = isinstance(desc, Param | Buffer | Closure | Global)
        if is_lifted != (i < len(lifted)):  # lifted tensors lead (Lifted, in signature/)
            raise CallError(
                f"expected the {len(lifted)} lifted tensors first among the graph inputs,"
                f" got {desc} at position {i}"
            )
        tensor = lifted[i] if is_lifted else None
        in_spec = _input_spec(node, desc, tensor, state, constants)
        inputs.append(InputSpec(InputKind.USER_INPUT, in_spec.arg, None) if flat else in_spec)
    inputs += _lift_constants(gm, graph, constants)
    # torch.export wants mutations first, then user outputs, then gradients.
    groups: tuple[list[tuple[fx.Node, OutputSpec, Descriptor]], ...] = ([], [], [])
    for out, result in zip(outputs, output_descs, strict=True):
        if result is None or (out is None and isinstance(result, Grad)):
            continue  # no gradient: left out
        if out is None:
            raise CallError(f"expected a tensor for the graph output {result}, got None")
        _annotate(out, result, output=True)
        if flat and isinstance(result, MutatedInput):  # of anything: it is returned
            group, spec = 0, OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(out.name), None)
        else:
            group, spec = _output_spec(out, result, names)
        if flat:
            spec = OutputSpec(OutputKind.USER_OUTPUT, spec.arg, None)
        groups[group].append((out, spec, result))
    ordered = [*groups[0], *groups[1], *groups[2]]
    _set_outputs(graph, [out for out, _, _ in ordered])
    n_user_inputs = sum(s.kind == InputKind.USER_INPUT for s in inputs)
    returned_groups = (*groups[0], *groups[1], *groups[2]) if flat else (*groups[1], *groups[2])
    returned = tuple(result for _, _, result in returned_groups)
    specs = [spec for _, spec, _ in ordered]
    if flat:
        state = {}
        constants = {k: v for k, v in constants.items() if k in _targets(inputs)}
    program = _program(graph, inputs, specs, state, n_user_inputs, len(returned), constants)
    return program, returned


def _targets(specs: Sequence[InputSpec]) -> set[str]:
    return {s.target for s in specs if s.target is not None}


def _output_spec(
    out: fx.Node, result: Descriptor, names: dict[Descriptor, str]
) -> tuple[int, OutputSpec]:
    """One output's spec and group: 0 mutation, 1 user output, 2 gradient."""
    arg = TensorArgument(name=out.name)
    if isinstance(result, MutatedInput):
        of = result.of
        if isinstance(of, Buffer):
            return 0, OutputSpec(OutputKind.BUFFER_MUTATION, arg, of.name)
        if isinstance(of, Param):
            return 0, OutputSpec(OutputKind.PARAMETER_MUTATION, arg, of.name)
        if isinstance(of, Input | InputBase):
            return 0, OutputSpec(OutputKind.USER_INPUT_MUTATION, arg, names[of])
    elif isinstance(result, Output | OutputBase | Saved):
        return 1, OutputSpec(OutputKind.USER_OUTPUT, arg, None)
    elif isinstance(result, Grad):
        of = result.of
        if isinstance(of, Param):
            return 2, OutputSpec(OutputKind.GRADIENT_TO_PARAMETER, arg, of.name)
        if isinstance(of, Input | InputBase) and of in names:  # a placeholder of this graph
            return 2, OutputSpec(OutputKind.GRADIENT_TO_USER_INPUT, arg, names[of])
        if isinstance(of, Input | InputBase | Closure | Global):
            return 1, OutputSpec(OutputKind.USER_OUTPUT, arg, None)
    raise _unsupported(result, "graph output")


def _lift_constants(
    gm: fx.GraphModule, graph: fx.Graph, constants: dict[str, torch.Tensor]
) -> list[InputSpec]:
    """Each tensor the graph reads as an attribute of ``gm`` (``_tensor_constant0``: a
    tensor made at capture, e.g. by ``torch.tensor(...)`` in the model) becomes a
    CONSTANT_TENSOR placeholder after the others, as ``torch.export`` lifts constants."""
    specs = []
    last = list(graph.find_nodes(op="placeholder"))[-1:]
    for node in list(graph.find_nodes(op="get_attr")):
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            raise CallError(
                f"expected the graph's attribute {node.target} to be a tensor, got"
                f" {type(value).__name__}; export takes graphs of aten ops on tensors"
            )
        target = f"aotgrad_{node.target}"
        if target in constants:
            raise CallError(f"expected one tensor named {target} in the program, got two")
        constants[target] = value.detach()
        with graph.inserting_after(last[0]) if last else graph.inserting_before(None):
            placeholder = graph.placeholder(f"c_{node.target}".lstrip("_"))
        placeholder.meta = dict(node.meta)
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        last = [placeholder]
        specs.append(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(placeholder.name), target))
    return specs


def _input_spec(
    node: fx.Node,
    desc: Descriptor,
    tensor: torch.Tensor | None,
    state: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
) -> InputSpec:
    """The spec of one input; a lifted ``tensor`` goes into ``state`` or ``constants``."""
    arg = TensorArgument(name=node.name)
    if isinstance(desc, Input | InputBase | Saved | Cotangent | Draw):
        return InputSpec(InputKind.USER_INPUT, arg, None)
    if not isinstance(desc, Param | Buffer | Closure | Global) or tensor is None:
        raise _unsupported(desc, "graph input")
    val = node.meta["val"]
    if (tensor.shape, tensor.stride(), tensor.dtype) != (val.shape, val.stride(), val.dtype):
        raise CallError(
            f"the graphs were captured for {desc} of size {tuple(val.shape)}, strides"
            f" {val.stride()} and {val.dtype}, and it now holds a tensor of size"
            f" {tuple(tensor.shape)}, strides {tensor.stride()} and {tensor.dtype}; call the"
            " function again (or trace again) before exporting"
        )
    if isinstance(desc, Param):
        if not isinstance(tensor, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad)
        state[desc.name] = tensor
        return InputSpec(InputKind.PARAMETER, arg, desc.name)
    if isinstance(desc, Buffer):
        state[desc.name] = tensor
        return InputSpec(InputKind.BUFFER, arg, desc.name, persistent=True)
    target = f"aotgrad_{node.name}"  # a closure or global; its text may be any string
    if target in state or target in constants:
        raise CallError(f"expected one tensor named {target} in the program, got two")
    constants[target] = tensor.detach()  # a constant; the backward gives its gradient
    return InputSpec(InputKind.CONSTANT_TENSOR, arg, target)


def _copy(gm: fx.GraphModule) -> tuple[fx.Graph, list[fx.Node], list[fx.Node | None]]:
    """A copy of ``gm``'s graph (meta dicts copied, values shared), its placeholders and outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    placeholders = list(graph.find_nodes(op="placeholder"))
    results = graph.output_node().args[0]
    if not isinstance(results, tuple | list):
        raise CallError(f"expected a graph returning a tuple, got {results!r}")
    flat: list[fx.Node | None] = []
    for r in results:
        if r is not None and not isinstance(r, fx.Node):
            raise CallError(f"expected graph outputs that are tensors, got {r!r}")
        flat.append(r)
    _check_static([*placeholders, *(r for r in flat if r is not None)])
    for node in graph.nodes:
        if node.op != "output":
            _plain_meta(node)
    return graph, placeholders, flat


def _check_static(nodes: Sequence[fx.Node]) -> None:
    for node in nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not is_static(val):
            raise CallError(  # TensorArgument and empty range constraints would misname it
                f"export takes graphs whose inputs and outputs are tensors of static sizes;"
                f" {node.name} is {val!r}. Trace without dynamic=True or aotgrad.dynamic"
                " marks to export"
            )


def _plain_meta(node: fx.Node) -> None:
    """aotgrad's provenance as plain data, under ``aotgrad`` and ``custom['aotgrad']``."""
    info = node.meta.get("aotgrad")
    plain: dict[str, Any] = info.to_dict() if isinstance(info, NodeInfo) else {}
    node.meta.pop("desc", None)
    node.meta["aotgrad"] = plain
    node.meta["custom"] = {**node.meta.get("custom", {}), "aotgrad": plain}


def _annotate(node: fx.Node, desc: Descriptor, output: bool = False) -> None:
    key = "output" if output else "descriptor"
    node.meta["aotgrad"] = {**node.meta["aotgrad"], key: desc.to_dict()}
    node.meta["custom"]["aotgrad"] = node.meta["aotgrad"]


def _set_outputs(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    output = graph.output_node()
    output.args = (tuple(nodes),)
    graph.eliminate_dead_code()


def _program(
    graph: fx.Graph,
    inputs: list[InputSpec],
    outputs: list[OutputSpec],
    state: dict[str, torch.Tensor],
    n_user_inputs: int,
    n_user_outputs: int,
    constants: dict[str, Any] | None = None,
) -> ExportedProgram:
    in_spec = pytree.tree_flatten((tuple(range(n_user_inputs)), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(n_user_outputs)))[1]
    entry = ModuleCallEntry(
        fqn="",
        signature=ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec),
    )
    root = torch.nn.Module()
    return ExportedProgram(
        root=root,
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs=inputs, output_specs=outputs),
        state_dict=state,
        range_constraints={},
        module_call_graph=[entry],
        constants=constants,
    )


def _check_count(what: str, nodes: Sequence[Any], descs: Sequence[Any]) -> None:
    if len(nodes) != len(descs):
        raise CallError(f"expected {len(descs)} {what} (one per descriptor), got {len(nodes)}")


def _unsupported(desc: Descriptor, where: str) -> CallError:
    return CallError(
        f"export cannot name the {where} {desc} ({type(desc).__name__}) in a torch.export"
        " graph signature (Note [Export signatures] in aotgrad/export.py). Export takes"
        " plain tensors (not a tensor subclass's inner tensors: pass plain tensors), and"
        " mutations and gradients of parameters, buffers and inputs only (a closed-over"
        " tensor the function mutates: make it a buffer of a module, or an argument)"
    )
