"""What every backend of the flat exported programs shares (docs/backends.md).

A backend compiles one program of ``traced.export(flat=True)`` into a callable over tensors.
Written here once: the program's kind (:func:`program_kind`), the flat signature and each
input's and output's spec (:meth:`Backend.user_specs`), the refusal of random ops and of
what the backend's own checks find (:meth:`Backend.refuse`), the nodes a message names
(:func:`describe`, :meth:`Backend.ops_at`), the call's checks (:class:`CompiledProgram`) and
tensors across NumPy (:func:`to_numpy`, :func:`from_numpy`).

A third backend is its compile function and its rewrites. Here torch itself is the compiler;
a real backend calls its own where ``program.module()`` stands, and decomposes the backward
ops it lacks first (``aotgrad.ops.backward_ops.decompose``)::

    >>> import torch, aotgrad
    >>> from aotgrad.backends import base
    >>> EAGER = base.Backend("eager", "torch", base.NUMPY_DTYPES)
    >>> def compile_program(program):
    ...     kind = base.program_kind(program)
    ...     inputs, outputs = EAGER.user_specs(program, kind)  # refuses a program not flat
    ...     EAGER.refuse(program, kind)  # random ops, and the backend's own checks
    ...     run = program.module()
    ...     return lambda *tensors: tuple(run(*tensors))
    >>> lin, x = torch.nn.Linear(3, 2), torch.ones(4, 3)
    >>> programs = aotgrad.trace(lambda x: lin(x).sum(), x).export(flat=True)
    >>> backward = compile_program(programs.backward)
    >>> [tuple(g.shape) for g in backward(x, torch.ones(()))]
    [(2, 3), (2,)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from aotgrad.errors import BackendError, CallError
from aotgrad.ops.table import draws_random, op_name

__all__ = [
    "NUMPY_DTYPES",
    "REWRITE_OF",
    "SHOWN",
    "Backend",
    "CompiledProgram",
    "Specs",
    "TensorSpec",
    "calls",
    "describe",
    "from_numpy",
    "program_kind",
    "to_numpy",
]

# The torch dtypes NumPy holds, and the NumPy dtype each travels as (a backend that passes
# bfloat16 adds ``ml_dtypes.bfloat16``).
NUMPY_DTYPES: Mapping[torch.dtype, Any] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
}

# The meta key that names, on a node a backend's rewrite made, the op it was rewritten from.
REWRITE_OF = "aotgrad_rewrite_of"

# How many nodes a message lists.
SHOWN = 8


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one input or output of a program, from its node's
    ``meta["val"]``; ``name``: the node's (empty where nobody asked)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str = ""

    @property
    def layout(self) -> str:
        """``float32[4, 6]``."""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"

    def __str__(self) -> str:
        return f"{self.name}: {self.layout}" if self.name else self.layout


# The specs of a program's inputs or outputs, in order.
Specs = Sequence[TensorSpec]


# Note [Program kinds]
# ~~~~~~~~~~~~~~~~~~~
# A backend's messages say which program they are about. aotgrad's export puts a descriptor
# on every placeholder (``meta["aotgrad"]["descriptor"]``, Note [Export signatures]), and the
# kinds of those descriptors say what the program computes:
#
#   descriptor kinds of the inputs                      the program
#   Param, Buffer, Closure, Global, Input, InputBase    "forward"
#   Saved and Cotangent only                            "backward"
#   Cotangent with any of the forward's                 "joint"     (export(joint=True))
#   none (a program aotgrad did not export)             "exported"
#
# e.g. the joint program of ``lambda x: lin(x).sum()`` takes (Global(lin.weight),
# Global(lin.bias), Input(x), Cotangent(of=Output(""))): a cotangent, like a backward, but the
# forward's inputs too: "joint", not "backward". A backward whose cotangents nothing reads still has them as
# placeholders; one of saved values only is "backward" all the same.
_BACKWARD_KINDS = frozenset({"Saved", "Cotangent"})


def program_kind(program: ExportedProgram) -> str:
    """``"forward"``, ``"backward"``, ``"joint"`` or ``"exported"`` (Note [Program kinds])."""
    kinds = set()
    for node in program.graph.find_nodes(op="placeholder"):
        descriptor = _info(node).get("descriptor")
        if isinstance(descriptor, dict):
            kinds.add(descriptor.get("kind"))
    if not kinds:
        return "exported"
    if kinds <= _BACKWARD_KINDS:
        return "backward"
    return "joint" if "Cotangent" in kinds else "forward"


# A check of a backend's own: what in ``program`` it would run unlike torch, as the rest of a
# sentence that starts "the forward program ..." (naming the nodes), or None.
Check = Callable[[ExportedProgram], str | None]


@dataclass(frozen=True)
class Backend:
    """One backend, as its messages name it and as far as its inputs and outputs go."""

    # The name ``step`` knows it by, which starts the errors it raises: "onnxruntime".
    key: str
    # Its name in a sentence: "ONNX Runtime".
    name: str
    # The dtypes it passes, each to the NumPy dtype it travels as.
    dtypes: Mapping[torch.dtype, Any]

    def user_specs(
        self, program: ExportedProgram, kind: str
    ) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The specs of ``program``'s user inputs and outputs, in order; refuses a program
        that is not flat (every input a USER_INPUT or a tensor made at capture, every
        output a USER_OUTPUT, all of them tensors)."""
        self.check_flat(program, kind)
        return self.specs(program, kind, "input"), self.specs(program, kind, "output")

    def check_flat(self, program: ExportedProgram, kind: str) -> None:
        signature = program.graph_signature
        kept = (InputKind.USER_INPUT, InputKind.CONSTANT_TENSOR)
        other = [s for s in signature.input_specs if s.kind not in kept]
        other += [s for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
        other += [
            s
            for s in (*signature.input_specs, *signature.output_specs)
            if not isinstance(s.arg, TensorArgument) and s not in other
        ]
        if other:
            named = ", ".join(
                f"{s.kind.name} {s.target or getattr(s.arg, 'name', s.arg)}" for s in other[:SHOWN]
            )
            raise BackendError(
                f"{self.key}: the {kind} program has inputs or outputs that are not the"
                f" user's tensors ({named}); {self.name} takes a program as a pure function of"
                " tensors, and would drop mutations and parameter gradients. Export with"
                " traced.export(flat=True)"
            )

    def specs(self, program: ExportedProgram, kind: str, role: str) -> list[TensorSpec]:
        """The spec of every user input (``role="input"``) or output of ``program``; refuses
        symbolic sizes and the dtypes this backend does not pass."""
        signature = program.graph_signature
        if role == "input":
            args = [s.arg for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
        else:
            args = [s.arg for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
        nodes = {n.name: n for n in program.graph.nodes}
        return [self._spec(nodes[arg.name], kind, role) for arg in args]

    def _spec(self, node: fx.Node, kind: str, role: str) -> TensorSpec:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise BackendError(
                f"expected the {kind} program's {role} {node.name} to be a tensor, got {val!r}"
            )
        shape = tuple(val.shape)
        if not all(isinstance(n, int) for n in shape):
            raise BackendError(
                f"{self.key}: the {kind} program's {role} {node.name} has symbolic sizes"
                f" {list(shape)}; {self.name} runs programs of one specialization only"
            )
        if val.dtype not in self.dtypes:
            raise BackendError(
                f"{self.key}: the {kind} program's {role} {node.name} is a {val.dtype} tensor,"
                f" which aotgrad cannot pass to {self.name} (its tensors go through NumPy:"
                f" {', '.join(sorted(str(d) for d in self.dtypes))}). Cast it in the function,"
                " or run the program with torch or another backend"
            )
        return TensorSpec(shape, val.dtype, node.name)

    def refuse(self, program: ExportedProgram, kind: str, *checks: Check) -> None:
        """Refuses what the backend would run unlike torch without an error: random ops
        (Note [Backends and random ops]) and what ``checks`` find, in one error."""
        problems = [p for check in (self.random_ops, *checks) if (p := check(program))]
        if len(problems) == 1:
            raise BackendError(f"{self.key}: the {kind} program {problems[0]}")
        if problems:
            raise BackendError(
                f"{self.key}: the {kind} program cannot run in {self.name} as it runs in"
                " torch:\n" + "\n".join(f"- it {problem}" for problem in problems)
            )

    def random_ops(self, program: ExportedProgram) -> str | None:
        """Note [Backends and random ops]."""
        drawing = [
            node
            for node in calls(program)
            if draws_random(node.target, tuple(node.args), dict(node.kwargs))
        ]
        if not drawing:
            return None
        return (
            f"draws random numbers, which {self.name} cannot draw as torch does (its masks"
            f" would not be eager's: Note [Backends and random ops]):\n{describe(drawing)}\n"
            "  Export with the draws as inputs (export(flat=True, random='inputs'), and pass"
            " programs.draw() after the inputs: aotgrad.backends.step does), or run the"
            " program with torch"
        )

    def ops_at(self, nodes: Sequence[fx.Node]) -> str:
        """``aten.bernoulli.p (node bernoulli, drop, at model.py:12: x = self.drop(x))``;
        ...: each node's op, name, module and the user's line, for a sentence."""
        parts = []
        for node in nodes[:6]:
            info = _info(node)
            where = [f"node {node.name}"]
            if info.get("module"):
                where.append(str(info["module"]))
            source = info.get("source")
            if isinstance(source, dict):
                where.append(f"at {source.get('file')}:{source.get('line')}: {source.get('code')}")
            op = op_name(node.target)
            original = node.meta.get(REWRITE_OF)
            if original:
                rewritten = f"rewritten for {self.name} as {op}" if original != op else "rewritten"
                where.insert(1, rewritten)
                op = original
            parts.append(f"{op} ({', '.join(where)})")
        more = f" and {len(nodes) - 6} more" if len(nodes) > 6 else ""
        return "; ".join(parts) + more


class CompiledProgram:
    """One program a backend compiled: its kind and the specs of its user inputs and
    outputs, in order. A backend's subclass runs it in ``__call__``, with the checks below."""

    def __init__(
        self,
        backend: Backend,
        kind: str,
        inputs: Specs,
        outputs: Specs,
    ) -> None:
        self.backend = backend
        self.kind = kind  # "forward", "backward", ...: Note [Program kinds]
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)

    def check_inputs(self, inputs: Sequence[object]) -> None:
        """As many inputs as the program takes (each one's spec: the backend's checks)."""
        if len(inputs) != len(self.inputs):
            raise CallError(
                f"the {self.kind} program compiled by {self.backend.name} takes"
                f" {len(self.inputs)} input tensor(s), got {len(inputs)}; it takes"
                f" {', '.join(map(str, self.inputs)) or 'none'}"
            )

    def check_results(self, results: Sequence[object]) -> None:
        """As many results as the program returns (a backend that returns others is wrong)."""
        if len(results) != len(self.outputs):
            raise BackendError(
                f"{self.backend.name}'s {self.kind} program returned {len(results)} value(s),"
                f" expected {len(self.outputs)}; run the program in another backend"
            )


# Note [Backends and random ops]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A backend draws from its own generator: ``bernoulli.p(x, 0.9)``, dropout's mask, becomes
# ONNX's ``RandomUniformLike`` and a comparison (or IREE's generator), whose mask has nothing
# to do with the one eager torch draws from the same seed, and the backward (another
# program) could not reproduce it. A program whose op draws from the RNG
# (``aotgrad.ops.table.draws_random``: dropout with p > 0 in training, ``bernoulli``,
# ``rand_like``, attention with ``dropout_p`` > 0) is refused when it is compiled; dropout at
# p = 0, or in eval mode, draws nothing and runs. Programs exported with their draws as inputs
# (``export(random="inputs")``, the default for flat programs: Note [Random draws as inputs])
# hold no random op, and ``step`` makes their draws with torch, so they train with eager's masks.


def calls(program: ExportedProgram) -> list[fx.Node]:
    """The program's ``call_function`` nodes, in order."""
    return [n for n in program.graph.nodes if n.op == "call_function"]


def describe(nodes: Sequence[fx.Node]) -> str:
    """One line per op and user line (aotgrad's metadata), the first ``SHOWN`` of them:
    ``  aten.bernoulli.p at model.py:12 in forward: x = self.drop(x) (module drop)``."""
    lines = list(dict.fromkeys(f"  {op_name(node.target)}{_site(node)}" for node in nodes))
    more = f"\n  ... and {len(lines) - SHOWN} more" if len(lines) > SHOWN else ""
    return "\n".join(lines[:SHOWN]) + more


def _site(node: fx.Node) -> str:
    info = _info(node)
    source, module = info.get("source"), info.get("module")
    where = ""
    if isinstance(source, dict):
        where = (
            f" at {source.get('file')}:{source.get('line')} in {source.get('function')}:"
            f" {source.get('code')}"
        )
    return where + (f" (module {module})" if module else "")


def _info(node: fx.Node) -> dict[str, Any]:
    """aotgrad's plain metadata of ``node``; ``custom``: where the exporter's decompositions
    keep the metadata of a node they rewrote."""
    info = node.meta.get("aotgrad") or node.meta.get("custom", {}).get("aotgrad")
    return info if isinstance(info, dict) else {}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s data as a C-contiguous NumPy array on the CPU (a copy where it must be);
    bfloat16 as ``ml_dtypes.bfloat16`` (NumPy has none: the bits travel as int16)."""
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes  # a dependency of the backends that pass bfloat16

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``array`` as a tensor sharing its memory; ``dtype``: the tensor's, for bfloat16."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
