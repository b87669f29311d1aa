"""IREE as a backend of the flat exported programs (docs/backends.md, Note [IREE programs]).

:func:`compile_program` imports one program of ``traced.export(flat=True)`` into MLIR's torch
dialect with IREE's FX importer (torch-mlir's), compiles it for the host CPU with
``iree-compile`` and returns a callable that runs it in IREE's runtime, in this process.
Nothing is written to disk.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.export import ExportedProgram

from aotgrad._torch_compat import OpOverload
from aotgrad.backends import base
from aotgrad.errors import BackendError, CallError
from aotgrad.ops import backward_ops
from aotgrad.ops.table import op_name

try:
    import iree.compiler as iree_compiler
    import iree.runtime as iree_runtime
    import ml_dtypes
    from iree.compiler.extras.fx_importer import FxImporter, GraphNodeImporter
except ImportError as error:  # an optional dependency
    raise BackendError(
        f"the IREE backend needs iree-base-compiler and iree-base-runtime ({error}): install"
        " them with `pip install aotgrad[backends]`"
    ) from error

__all__ = ["FLAGS", "IreeProgram", "compile_program"]

# Note [IREE programs]
# ~~~~~~~~~~~~~~~~~~~~
# A flat program (Note [Export signatures]) is a pure function of tensors, the form IREE
# compiles. ``compile_program`` takes it in four steps, each of which refuses loudly what it
# cannot keep exact:
#
# 1. Checks. Every input is a USER_INPUT (or a CONSTANT_TENSOR: a tensor made at capture,
#    part of the function, which the importer inlines into the module) and every output a
#    USER_OUTPUT tensor of a dtype IREE's runtime passes (not complex, not float8). No op may
#    draw random numbers (Note [Backends and random ops]). These checks are every backend's
#    (``base.Backend``); IREE's own: no
#    op may write its arguments (``aten.add_``): the importer gives every tensor value
#    semantics, and the write would be lost (aotgrad's graphs are functional; an edited one
#    may not be).
# 2. Import. ``FxImporter().import_program`` gives ``func.func @main`` over
#    ``!torch.vtensor``s, one argument per USER_INPUT in order, one result per output. It
#    is given a copy of the program (nodes and meta dicts copied, tensors shared): the
#    importer rewrites ``aten.as_strided`` into a gather in place, aotgrad rewrites the ops
#    IREE refuses or computes unlike torch (Note [IREE rewrites]), and every node gets the
#    MLIR location ``aotgrad-node:<name>`` in place of the one the importer would read from
#    the node's stack trace, so no text of the user's (file names, source) enters the
#    module; the caller's program stays as it was.
# 3. Compile. ``iree-compile --iree-input-type=torch`` for ``llvm-cpu`` and the host CPU, with
#    ``--iree-input-demote-f64-to-f32=false``: IREE demotes float64 to float32 by default, and
#    a float64 program would then compute in float32 (or fail at its first call, when the
#    runtime meets 8-byte arguments in 4-byte buffers). A failure's diagnostics carry the
#    locations of step 2, so ``BackendError`` names the very node (not every convolution
#    of the model), its module and the user's line; an error at no node (a constant an
#    unlowered op still uses, as ``aten.avg_pool2d_backward``'s kernel size) is followed by
#    a run to the end of IREE's input conversion, and the ``torch.aten`` ops left in it are
#    named.
# 4. Run. The inputs are checked against the program's (shape and dtype: the runtime would
#    reinterpret the bytes of an int32 tensor passed for an int64 argument), made contiguous
#    (IREE's tensors are values, in row-major order) and passed as numpy arrays. Every
#    result is copied into a new torch tensor: IREE returns one buffer for two results of
#    the same value (``return y, y``), read through a mapping of its memory, and two
#    gradients must not change together when one is updated in place. Each result's shape
#    and dtype are checked against the program's output; a mismatch raises instead of
#    returning a wrong tensor.
#
# For ``nn.Linear(3, 2)`` with loss ``lin(x).sum()``, the backward program is
# ``(x, cotangent) -> (grad weight, grad bias)``; ``compile_program(programs.backward)``
# gives ``main(x: [4,3] f32, cotangent: [] f32) -> ([2,3] f32, [2] f32)``, called as
# ``run(x, torch.ones(()))``.

# Backward ops IREE 3.13 cannot compile (densenet's and timm resnet10t's average pooling,
# adaptive pooling to more than 1x1: "failed to legalize"), written as the transposed
# convolution or matmuls they are before import (ops/backward_ops.py). Convolution's
# backward compiles as it is.
IREE_AS_FORWARD_OPS = (
    torch.ops.aten.avg_pool2d_backward.default,
    torch.ops.aten.avg_pool3d_backward.default,
    torch.ops.aten._adaptive_avg_pool2d_backward.default,
    torch.ops.aten._adaptive_avg_pool3d_backward.default,
)

# Arguments of ``iree-compile`` (Note [IREE programs], 3).
FLAGS: tuple[str, ...] = (
    "--iree-llvmcpu-target-cpu=host",
    "--iree-input-demote-f64-to-f32=false",
)

# The torch dtypes the runtime passes, and the NumPy dtype each travels as.
IREE = base.Backend("iree", "IREE", {**base.NUMPY_DTYPES, torch.bfloat16: ml_dtypes.bfloat16})

# The file name of the locations ``_locate`` gives each node, before the node's name.
_NODE_FILE = "aotgrad-node:"
_DIAGNOSED_NODE = re.compile(re.escape(_NODE_FILE) + r"([A-Za-z0-9_]+)")

# An op named in a compiler diagnostic: ``torch.aten.name[.overload]``, also as the name a
# ``torch.operator`` carries (an op the torch dialect does not know).
_DIAGNOSED_OP = re.compile(r"torch\.aten\.[A-Za-z0-9_.]*[A-Za-z0-9_]")


class IreeProgram(base.CompiledProgram):
    """One program compiled by IREE; call it with the program's user inputs, in order."""

    def __init__(self, vmfb: bytes, kind: str, inputs: base.Specs, outputs: base.Specs) -> None:
        super().__init__(IREE, kind, inputs, outputs)
        context = iree_runtime.SystemContext(config=_config())
        context.add_vm_module(iree_runtime.VmModule.copy_buffer(context.instance, vmfb))
        self._main = context.modules.module["main"]
        self._context = context  # the function runs in it

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.check_inputs(inputs)
        arrays = [
            _to_numpy(t, want, self.kind, i)
            for i, (t, want) in enumerate(zip(inputs, self.inputs, strict=True))
        ]
        results = self._main(*arrays)
        if not isinstance(results, tuple | list):  # one result comes alone
            results = (results,)
        self.check_results(results)
        return tuple(
            _to_torch(r, want, self.kind, i)
            for i, (r, want) in enumerate(zip(results, self.outputs, strict=True))
        )


def compile_program(program: ExportedProgram) -> IreeProgram:
    """``program`` (one of ``traced.export(flat=True)``) compiled by IREE for this CPU.

    >>> import torch, aotgrad
    >>> from aotgrad.backends import iree
    >>> lin, x = torch.nn.Linear(3, 2), torch.ones(4, 3)
    >>> traced = aotgrad.trace(lambda x: lin(x).sum(), x)
    >>> backward = iree.compile_program(traced.export(flat=True).backward)
    >>> [tuple(g.shape) for g in backward(x, torch.ones(()))]
    [(2, 3), (2,)]
    """
    kind = base.program_kind(program)
    inputs, outputs = IREE.user_specs(program, kind)  # Note [IREE programs], 1
    IREE.refuse(program, kind, _mutation)
    program = _copy(program)  # Note [IREE programs], 2
    program = backward_ops.decompose(program, IREE_AS_FORWARD_OPS)
    _rewrite(program)
    _locate(program)
    text = _import(program, kind)
    vmfb = _compile(text, program, kind)
    return IreeProgram(vmfb, kind, inputs, outputs)


@functools.cache
def _config() -> Any:
    """The runtime's CPU device (with its task threads), shared by every program."""
    return iree_runtime.Config("local-task")


def _mutation(program: ExportedProgram) -> str | None:
    """An op that writes one of its arguments (Note [IREE programs], 1): the importer gives
    every tensor value semantics, so the write would be lost."""
    writing = [
        node
        for node in base.calls(program)
        if isinstance(node.target, OpOverload) and node.target._schema.is_mutable
    ]
    if not writing:
        return None
    return (
        f"writes its tensors in place ({IREE.ops_at(writing)}); IREE takes functional"
        " programs, where every write is a new value. Export the programs aotgrad's capture"
        " made (traced.export(flat=True)), not an edited graph"
    )


def _import(program: ExportedProgram, kind: str) -> str:
    """The program as MLIR text in the torch dialect (Note [IREE programs], 2)."""
    importer = FxImporter(graph_node_importer_cls=_NamingNodeImporter)
    try:
        importer.import_program(program, func_name="main")
    except _NodeImportError as error:
        cause = error.__cause__
        raise BackendError(
            f"IREE's FX importer could not take {IREE.ops_at([error.node])} of the {kind}"
            f" program: {type(cause).__name__}: {_first_line(cause)}. {_advice()}"
        ) from cause
    except Exception as error:  # the importer raises what its checks raise
        raise BackendError(
            f"IREE's FX importer could not take the {kind} program:"
            f" {type(error).__name__}: {_first_line(error)}. {_advice()}"
        ) from error
    return str(importer.module.operation.get_asm(enable_debug_info=True))


def _copy(program: ExportedProgram) -> ExportedProgram:
    """``program`` with a copy of its graph (the nodes' meta dicts copied, values shared)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    return ExportedProgram(
        root=program.graph_module,  # the attributes the graph reads, if any
        graph=graph,
        graph_signature=program.graph_signature,
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        constants=program.constants,
    )


def _locate(program: ExportedProgram) -> None:
    """Gives every node of ``program`` (a copy) the MLIR location ``aotgrad-node:<name>``,
    so that a compiler diagnostic names the node it is about (Note [IREE programs], 3): the
    importer reads locations from the ``File "...", line N,`` frames of a node's stack trace."""
    for node in program.graph.nodes:
        node.meta["stack_trace"] = f'  File "{_NODE_FILE}{node.name}", line 1, in {node.name}\n'


# Note [IREE rewrites]
# ~~~~~~~~~~~~~~~~~~~~
# Core ATen ops that IREE 3.13 refuses, or compiles unlike torch, each rewritten before
# import into ops it compiles exactly (checked against eager on edge values: signed zeros,
# infinities, NaN, negative operands, quotients past 2**24). One rule per op, in
# ``_REWRITES``; a rule returns the node that replaces ``node`` (or ``node`` itself where
# IREE takes it as it is), and every node it makes is inserted by ``_Emitter``, which gives
# it the fake value its op computes (the importer reads result types from ``meta["val"]``)
# and ``node``'s module and user line, so that a compiler error names the user's code.
# The replacement takes over the node's name and metadata; its shape and dtype must be the
# node's, or the rewrite raises.
#
# * ``aten.squeeze.dims`` (BatchNorm's Core ATen decomposition squeezes its statistics) is
#   not an op of the torch dialect: the importer emits ``torch.operator``, which nothing
#   lowers. The squeezed shape is static::
#
#       squeeze = aten.squeeze.dims(mean, [0, 2, 3])     # [1, 4, 1, 1] -> [4]
#       becomes  aten.reshape.default(mean, [4])
#
# * ``aten.fmod`` (``torch.roll`` in Core ATen indexes with ``fmod(start + arange(n), n)``:
#   Swin's shifted windows). ``fmod.Scalar`` is not lowered at all, and ``fmod.Tensor`` is
#   lowered as ``a - b * trunc(a / b)``: exact for integers (a truncating division, C's
#   sign rule), wrong for floats wherever ``a / b`` rounds (float32 ``fmod(15863342080.0,
#   0.3344)`` gave -531.2, torch 0.166; ``fmod(-6.0, 3.0)`` gave +0.0, torch -0.0). So:
#   integers keep (or, from a Scalar, get) IREE's ``fmod.Tensor``, its divisor a 0-d tensor
#   of the result's dtype::
#
#       fmod = aten.fmod.Scalar(add, 8)                  # int64: fmod(-7, 8) = -7
#       becomes  aten.fmod.Tensor(add, aten.full.default([], 8, dtype=torch.int64))
#
#   (an integer divisor 0 is refused: torch raises ZeroDivisionError). Floats use IREE's
#   ``remainder`` (``arith.remf``, exact like C's ``fmod``, then a sign fix that does
#   nothing for non-negative operands) on magnitudes, and take the sign of ``a``, zeros
#   included::
#
#       r = remainder(abs(a), abs(b))                    # fmod(-7.5, 2.0): r = 1.5
#       fmod = where(r == 0, a * 0, where(a < 0, -r, r)) # -1.5; fmod(-6.0, 3.0) = -0.0
#
#   ``a * 0`` is a zero of ``a``'s sign; infinite ``a``, a zero or NaN ``b`` give NaN
#   through ``r``, as in C. Operands are first cast to the result's dtype (an integer
#   tensor with a float divisor computes in float32, as in torch). float64 is refused:
#   ``arith.remf`` on f64 calls libm's ``fmod``, which IREE's CPU executables do not link.
# * ``aten.constant_pad_nd`` with a negative amount (a crop: the backward of
#   ``F.pad(x, (0, 0, 1, 0))`` pads its gradient by -1) is refused by IREE's ``tensor.pad``.
#   The negative amounts become slices, as torch's own kernel narrows before it pads, and the
#   non-negative ones a pad (dropped when all are 0)::
#
#       pad = aten.constant_pad_nd.default(g, [0, 0, -1, 2])      # g: [4, 5, 3]
#       becomes  aten.constant_pad_nd.default(aten.slice.Tensor(g, 1, 1, 5), [0, 0, 0, 2])


class _Emitter:
    """Inserts the nodes of one rewrite before ``node`` (Note [IREE rewrites])."""

    def __init__(self, graph: fx.Graph, node: fx.Node) -> None:
        self.graph = graph
        self.node = node
        self._fake_mode = node.meta["val"].fake_mode

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        values = fx.node.map_arg(args, lambda arg: arg.meta["val"])
        with self._fake_mode:
            val = op(*values, **kwargs)
        with self.graph.inserting_before(self.node):
            new = self.graph.call_function(op, args, kwargs)
        info = self.node.meta.get("aotgrad", {})
        new.meta = {
            "val": val,
            "aotgrad": {key: info[key] for key in ("module", "source") if key in info},
            base.REWRITE_OF: op_name(self.node.target),
        }
        return new

    def cast(self, value: fx.Node, dtype: torch.dtype) -> fx.Node:
        """``value`` in ``dtype`` (itself if it is)."""
        if value.meta["val"].dtype == dtype:
            return value
        return self(torch.ops.aten._to_copy.default, value, dtype=dtype)


def _squeeze_dims(emit: _Emitter, node: fx.Node) -> fx.Node:
    """``aten.squeeze.dims(x, dims)`` as ``aten.reshape(x, shape)``: its values, in the
    squeezed shape (static: export takes static sizes only)."""
    shape = [int(n) for n in node.meta["val"].shape]
    return emit(torch.ops.aten.reshape.default, node.args[0], shape)


def _fmod(emit: _Emitter, node: fx.Node) -> fx.Node:
    """``aten.fmod.Scalar`` / ``aten.fmod.Tensor`` in ops IREE computes exactly
    (Note [IREE rewrites])."""
    aten = torch.ops.aten
    a, b = node.args[:2]
    dtype = node.meta["val"].dtype
    if dtype == torch.float64:
        raise BackendError(
            f"IREE cannot compute {IREE.ops_at([node])} exactly in float64: its CPU executables"
            " do not link libm's fmod, and its own lowering (a - b * trunc(a / b)) is wrong"
            " wherever a / b rounds. Run this program in another backend"
            " (step(programs, 'onnxruntime'))"
        )
    if not isinstance(b, fx.Node):  # fmod.Scalar: the divisor as a 0-d tensor
        if not dtype.is_floating_point and b == 0:
            raise BackendError(
                f"the program computes {IREE.ops_at([node])} by an integer 0, which raises"
                " ZeroDivisionError in torch; fix the divisor"
            )
        b = emit(aten.full.default, [], b, dtype=dtype)
    assert isinstance(a, fx.Node), a
    x, y = emit.cast(a, dtype), emit.cast(b, dtype)
    if not dtype.is_floating_point:  # IREE's integer fmod.Tensor is exact
        if node.target == aten.fmod.Tensor and (x, y) == (a, b):
            return node
        return emit(aten.fmod.Tensor, x, y)
    r = emit(aten.remainder.Tensor, emit(aten.abs.default, x), emit(aten.abs.default, y))
    signed = emit(aten.where.self, emit(aten.lt.Scalar, x, 0), emit(aten.neg.default, r), r)
    zero = emit(aten.mul.Scalar, x, 0)  # a zero of x's sign (x is finite where r == 0)
    return emit(aten.where.self, emit(aten.eq.Scalar, r, 0), zero, signed)


def _constant_pad_nd(emit: _Emitter, node: fx.Node) -> fx.Node:
    """``aten.constant_pad_nd`` with negative amounts as slices, then a pad of the
    non-negative ones (Note [IREE rewrites])."""
    x, amounts = node.args[:2]
    assert isinstance(x, fx.Node) and isinstance(amounts, Sequence), node.args
    pad = [int(p) for p in amounts]  # type: ignore[arg-type]  # ints: export is static
    if all(p >= 0 for p in pad):
        return node
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    shape = [int(n) for n in x.meta["val"].shape]
    for i in range(len(pad) // 2):  # pad[2i], pad[2i + 1]: before and after dim -1 - i
        dim, before, after = len(shape) - 1 - i, pad[2 * i], pad[2 * i + 1]
        if before < 0 or after < 0:
            start, end = max(-before, 0), shape[dim] + min(after, 0)
            x = emit(torch.ops.aten.slice.Tensor, x, dim, start, end)
    kept = [max(p, 0) for p in pad]
    if any(kept):
        x = emit(torch.ops.aten.constant_pad_nd.default, x, kept, value)
    return x


_REWRITES: dict[Any, Any] = {
    torch.ops.aten.squeeze.dims: _squeeze_dims,
    torch.ops.aten.fmod.Scalar: _fmod,
    torch.ops.aten.fmod.Tensor: _fmod,
    torch.ops.aten.constant_pad_nd.default: _constant_pad_nd,
}


def _rewrite(program: ExportedProgram) -> None:
    """Applies ``_REWRITES`` to ``program`` (a copy) in place (Note [IREE rewrites])."""
    graph = program.graph
    for node in base.calls(program):
        rule = _REWRITES.get(node.target)
        if rule is None:
            continue
        replacement = rule(_Emitter(graph, node), node)
        if replacement is node:
            continue
        want, got = node.meta["val"], replacement.meta["val"]
        if (want.shape, want.dtype) != (got.shape, got.dtype):
            raise BackendError(
                f"IREE's rewrite of {IREE.ops_at([node])}: expected a {list(want.shape)}"
                f" {want.dtype} result, got {list(got.shape)} {got.dtype}"
            )
        replacement.meta = {**node.meta, base.REWRITE_OF: op_name(node.target)}
        node.replace_all_uses_with(replacement)
        name = node.name
        graph.erase_node(node)
        replacement.name = name  # the signature names outputs by node name
    graph.lint()


class _NodeImportError(Exception):
    """An importer failure at one node (the cause), carried out to name the node."""

    def __init__(self, node: fx.Node) -> None:
        super().__init__(node.name)
        self.node = node


class _NamingNodeImporter(GraphNodeImporter):
    """The importer's node importer, noting which node an op failed at."""

    def _import_torch_op_overload(self, loc: Any, node: fx.Node, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._import_torch_op_overload(loc, node, *args, **kwargs)
        except Exception as error:
            raise _NodeImportError(node) from error


def _compile(text: str, program: ExportedProgram, kind: str) -> bytes:
    """The MLIR compiled into an IREE module for the host CPU (Note [IREE programs], 3)."""
    try:
        vmfb = iree_compiler.compile_str(
            text, input_type="torch", target_backends=["llvm-cpu"], extra_args=list(FLAGS)
        )
    except iree_compiler.CompilerToolError as error:
        diagnostics = str(error)
        located = set(_DIAGNOSED_NODE.findall(_error_lines(diagnostics)))
        names = _diagnosed_ops(_error_lines(diagnostics))
        nodes = [n for n in base.calls(program) if n.name in located]
        nodes = nodes or [n for n in base.calls(program) if _mlir_name(n) in names]
        if not nodes:  # an error at no op (a constant left over): the ops left unlowered
            names = _unlowered_ops(text)
            nodes = [n for n in base.calls(program) if _mlir_name(n) in names]
        what = IREE.ops_at(nodes) if nodes else ", ".join(sorted(names)) or "an op"
        raise BackendError(
            f"IREE could not compile {what} of the {kind} program:\n"
            f"{_diagnostic_lines(diagnostics)}\n{_advice()}"
        ) from error
    assert isinstance(vmfb, bytes)
    return vmfb


def _unlowered_ops(text: str) -> set[str]:
    """The ``torch.aten`` ops IREE's input conversion leaves in ``text`` when it fails: a
    failure that is reported at a constant an unlowered op still uses (``torch.constant.int``
    for ``aten.avg_pool2d_backward``'s kernel size) names no op itself."""
    try:
        iree_compiler.compile_str(
            text,
            input_type="torch",
            extra_args=[*FLAGS, "--compile-to=input", "--mlir-print-ir-after-failure"],
        )
    except iree_compiler.CompilerToolError as error:
        return _diagnosed_ops(str(error))
    return set()


def _diagnosed_ops(diagnostics: str) -> set[str]:
    """The ``torch.aten.*`` ops (and ``torch.operator`` names) an error names."""
    return set(_DIAGNOSED_OP.findall(diagnostics))


def _mlir_name(node: fx.Node) -> str:
    """The name the importer gives ``node``'s op: ``torch.aten.mm`` for ``aten.mm.default``,
    ``torch.aten.add.Tensor`` for ``aten.add.Tensor``."""
    target = node.target
    if not isinstance(target, OpOverload):
        return ""
    name = f"torch.{target.namespace}.{target._opname}"
    return name if target._overloadname == "default" else f"{name}.{target._overloadname}"


def _error_lines(diagnostics: str) -> str:
    return "\n".join(line for line in diagnostics.splitlines() if "error:" in line)


def _diagnostic_lines(diagnostics: str, limit: int = 8) -> str:
    """The ``error:`` lines of ``iree-compile``'s output, the first ``limit`` of them."""
    lines = [line.strip() for line in diagnostics.splitlines() if "error:" in line]
    if not lines:
        lines = [line.strip() for line in diagnostics.splitlines() if line.strip()][:limit]
    more = f"\n  ... ({len(lines) - limit} more)" if len(lines) > limit else ""
    shown = (line if len(line) <= 300 else line[:300] + " ..." for line in lines[:limit])
    return "\n".join(f"  {line}" for line in shown) + more


def _first_line(error: BaseException | None) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def _advice() -> str:
    return (
        "Trace with decompositions='core_aten' (the ops IREE's importer knows best), change"
        " the model to avoid the op, or run this program in another backend"
        " (step(programs, 'onnxruntime'))"
    )


def _to_numpy(tensor: torch.Tensor, want: base.TensorSpec, kind: str, index: int) -> np.ndarray:
    """One input as the runtime takes it: a contiguous CPU array (Note [IREE programs], 4)."""
    if not isinstance(tensor, torch.Tensor):
        raise CallError(
            f"the {kind} program's input {index} is {want}, got {type(tensor).__name__}"
        )
    if (tuple(tensor.shape), tensor.dtype) != (want.shape, want.dtype) or tensor.is_meta:
        raise CallError(
            f"the {kind} program compiled by IREE takes input {index} as {list(want.shape)}"
            f" {want.dtype}, got {list(tensor.shape)} {tensor.dtype}"
            + (" on the meta device" if tensor.is_meta else "")
            + ": pass the tensors the program was exported for"
        )
    return base.to_numpy(tensor)


def _to_torch(result: Any, want: base.TensorSpec, kind: str, index: int) -> torch.Tensor:
    """One result, copied into a new tensor, checked against the program's output."""
    array = np.array(result.to_host(), copy=True)
    if array.shape != want.shape or array.dtype != np.dtype(IREE.dtypes[want.dtype]):
        raise BackendError(
            f"IREE's {kind} program returned output {index} as {list(array.shape)}"
            f" {array.dtype}, and the program's output is {want}: it would not be the value"
            " torch computes. Run this program in another backend"
        )
    return base.from_numpy(array, want.dtype)
