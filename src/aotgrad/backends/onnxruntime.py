"""Exported programs run by ONNX Runtime: ``torch.onnx.export``, then an ``InferenceSession``
on the CPU (docs/backends.md, "ONNX Runtime").

``compile_program(program)`` takes one flat program of ``traced.export(flat=True)`` (every
input a ``USER_INPUT``, every output a ``USER_OUTPUT``) and returns a callable that runs it in
ONNX Runtime: called with the program's inputs in order, it returns its outputs in order, as
CPU tensors of the program's dtypes and shapes. What it cannot run faithfully it refuses with
:class:`~aotgrad.errors.BackendError` when it is built, naming the op and the user's line.

Note [ONNX Runtime inputs by name]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.onnx.export`` decomposes the program again (its own table, ``run_decompositions``),
which re-traces it and renames its placeholders; its optimizer renames an input the model
also returns (``arg_0`` -> ``arg_0_orig``, with an ``Identity`` to the output), and may drop
an input nothing reads. So the program's inputs are fed to the session by the model's own
names, never by position, through a map built once, when the program is compiled. For the
forward of ``x @ w`` whose backward saves ``x``::

    program placeholders   w,           x,           unused
    exporter's program     arg_0,       arg_1,       arg_2      (same order, same specs)
    ONNX inputs            arg_0,       arg_1_orig,  arg_2      (each made from a placeholder)
    feeds                  {"arg_0": w, "arg_1_orig": x, "arg_2": unused}

Each ONNX input keeps the exporter's placeholder it was made from (``value.meta["node"]``);
the exporter's program keeps the user inputs in the order of the program's (both are
``torch.export`` signatures of the same function, and every pair is checked to have the same
shape and dtype). An ONNX input traced to no placeholder, or a session whose inputs are not
exactly the mapped ones with their dtypes and shapes, is a ``BackendError``. The session's
outputs are the program's user outputs in order (the exporter builds them from the output
specs, in order, and its optimizer replaces an output in its place); their number, dtypes
and shapes are checked when the program is compiled, and every result's when it runs: a
mismatch is a ``BackendError``, never a cast.

Refused when a program is compiled, because ONNX Runtime would run it unlike torch without an
error: random ops (Note [Backends and random ops]), outputs the exporter fills with
stand-ins (Note [ONNX functions with filler outputs]), arguments it ignores (Note [ONNX
functions that ignore an argument]), and dtypes NumPy cannot hold (``bfloat16``, complex, the
float8 types: the session's inputs and outputs go through NumPy). ``convolution_backward``,
``avg_pool{2,3}d_backward`` and ``_adaptive_avg_pool{2,3}d_backward``, which the exporter
cannot take, are decomposed first (Note [Convolution backward as convolutions], Note [Average pooling
backward as a transposed convolution], Note [Adaptive average pooling backward as matmuls]); so is a write whose
source broadcasts (Note [ONNX copy drops the destination's shape]).
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram

from aotgrad.backends import base
from aotgrad.errors import BackendError, CallError
from aotgrad.ops import backward_ops
from aotgrad.ops.table import op_name

__all__ = ["OrtProgram", "compile_program"]

# The dtypes a program's inputs and outputs may have: each goes through NumPy unchanged.
ORT = base.Backend("onnxruntime", "ONNX Runtime", base.NUMPY_DTYPES)

# ONNX Runtime's names of those dtypes (``NodeArg.type``), to check the session's signature.
_ORT_TYPES = {
    torch.float16: "tensor(float16)",
    torch.float32: "tensor(float)",
    torch.float64: "tensor(double)",
    torch.int8: "tensor(int8)",
    torch.int16: "tensor(int16)",
    torch.int32: "tensor(int32)",
    torch.int64: "tensor(int64)",
    torch.uint8: "tensor(uint8)",
    torch.bool: "tensor(bool)",
}


_aten = torch.ops.aten


# Note [ONNX copy drops the destination's shape]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``aten.copy(self, src)`` (functionalization's write ``self[...] = src``) is ``src`` cast to
# ``self``'s dtype and broadcast to ``self``'s shape. The exporter's ONNX function is
# ``CastLike(src, self)`` (torchlib ``aten_copy``): it keeps ``src``'s shape. BART's and
# Whisper's ``shifted[:, 0] = start`` writes a 0-d ``start`` into a (2,) column: ONNX has a
# 0-d tensor where torch has (2,), and the ``unsqueeze(1)`` after it fails to load ("Unexpected
# axis value: 1. Expected range [-1, 1)"); torchvision's Swin writes a scalar into a slice of its
# attention mask, and ``Transpose`` fails the same way. Where the shapes do not clash, ONNX's
# broadcasting would carry the wrong shape on without a word (a sum over the written tensor
# would add one value instead of two). So, before exporting, a ``copy`` whose ``src`` has
# another shape than ``self`` is written as ``src.to(self.dtype).expand(self.shape)`` (then
# a ``clone``: copy's result is a tensor of its own), which is copy's own broadcast; and a
# broadcasting ``copy`` still in the exporter's program (made by its own decompositions) is
# refused when the program is compiled.


def _broadcasts(node: fx.Node) -> bool:
    """A ``copy`` node whose ``src`` has another shape than ``self``."""
    if node.target is not _aten.copy.default:
        return False
    shapes = [
        getattr(arg.meta.get("val"), "shape", None) if isinstance(arg, fx.Node) else None
        for arg in node.args[:2]
    ]
    return shapes[0] != shapes[1]


def _broadcast_copy(
    destination: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> Any:
    """``aten.copy`` as its own broadcast (Note [ONNX copy drops the destination's shape])."""
    if src.shape == destination.shape:
        return NotImplemented
    return src.to(destination.dtype).expand(destination.shape).clone()


# Ops the exporter has no faithful ONNX function for, decomposed by the backend before it
# exports: the backward ops of ``backward_ops.AS_FORWARD_OPS``, and a ``copy`` that broadcasts
# (only there: ``_DECOMPOSE_ONLY``).
_DECOMPOSITIONS: dict[Any, Any] = {
    **backward_ops.AS_FORWARD_OPS,
    _aten.copy.default: _broadcast_copy,
}
_DECOMPOSE_ONLY = {_aten.copy.default: _broadcasts}


def _decompose(program: ExportedProgram) -> ExportedProgram:
    """``program`` with the ops above decomposed (none there: itself)."""
    return backward_ops.decompose(program, _DECOMPOSITIONS, _DECOMPOSE_ONLY)


def _broadcasting_copies(program: ExportedProgram) -> str | None:
    """Note [ONNX copy drops the destination's shape], in the exporter's program."""
    found = [n for n in base.calls(program) if _broadcasts(n)]
    if not found:
        return None
    return (
        "has a copy that broadcasts its source, made by the exporter's decompositions, which"
        " its ONNX function does not (Note [ONNX copy drops the destination's shape]):\n"
        f"{base.describe(found)}\n"
        "  Capture with decompositions='core_aten', or run the program with torch"
    )


# Note [ONNX functions with filler outputs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some of the exporter's ONNX functions compute an op's first output and fill the others with
# zeros of the right (or not even the right) shape, for inference, where nobody reads them.
# ``aten._scaled_dot_product_flash_attention_for_cpu`` returns ``(output, logsumexp)``; torchlib
# computes ``output`` and returns ``Expand(0.0, ...)`` as ``logsumexp``. A training forward
# saves ``logsumexp`` for the attention's backward: ONNX Runtime would hand the backward zeros,
# without a word where the shapes agree. So a program that reads such an output (a ``getitem``
# of that index) is refused when it is compiled, naming the op and the user's line; a program
# that reads only the first output runs. ``decompositions="core_aten"`` captures attention as
# matmuls and a softmax, which export faithfully. The table lists, per op, the outputs the
# exporter fills (torchlib, ``nn.py`` and ``core.py``: ``..._fillin_empty_outputs``,
# ``embedding_bag``'s "we don't care the value", ``nll_loss_forward``'s "Fake a total_weight"):
# a cross-entropy captured with the default table saves ``total_weight`` (the number of
# targets counted) for ``nll_loss_backward``, which divides by it.
_FILLER_OUTPUTS: dict[Any, frozenset[int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: frozenset({1}),
    torch.ops.aten._scaled_dot_product_flash_attention.default: frozenset(range(1, 9)),
    torch.ops.aten._scaled_dot_product_efficient_attention.default: frozenset({1, 2, 3}),
    torch.ops.aten.embedding_bag.default: frozenset({1, 2, 3}),
    torch.ops.aten.embedding_bag.padding_idx: frozenset({1, 2, 3}),
    torch.ops.aten._embedding_bag.default: frozenset({1, 2, 3}),
    torch.ops.aten._embedding_bag_forward_only.default: frozenset({1, 2, 3}),
    # "FIXME: Fake a total_weight tensor for now": the number of outputs, 1 for a mean.
    torch.ops.aten.nll_loss_forward.default: frozenset({1}),
    # Eval-mode batch norm's saved mean and rstd are empty tensors; the exporter returns the
    # running statistics in their place.
    torch.ops.aten._native_batch_norm_legit_no_training.default: frozenset({1, 2}),
}


def _filler_outputs(program: ExportedProgram) -> str | None:
    """Note [ONNX functions with filler outputs]."""
    read = [
        node
        for node in base.calls(program)
        if node.target in _FILLER_OUTPUTS
        and any(
            user.target is operator.getitem and user.args[1] in _FILLER_OUTPUTS[node.target]
            for user in node.users
        )
    ]
    if not read:
        return None
    return (
        "reads an output that the ONNX exporter does not compute (its ONNX function"
        " returns a stand-in, zeros or a count: Note [ONNX functions with filler outputs]):"
        f"\n{base.describe(read)}\n"
        "  Capture with decompositions='core_aten', which writes these ops as ops the"
        " exporter computes, or run the program with torch or another backend"
    )


# Note [ONNX functions that ignore an argument]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some of the exporter's ONNX functions assume an argument's value whatever the program says.
# Batch norm sets ``training = False`` (torchlib ``core.py``: "ORT currently only supports
# training mode with opset version lower than 14"):
# ``_native_batch_norm_legit_functional(x, w, b, mean, var, True, 0.1, 1e-5)`` becomes
# ``BatchNormalization`` in inference mode, which normalizes with the running statistics (0 and
# 1 for a fresh ``BatchNorm2d``: the output is x) and returns them unchanged as the new ones;
# the loss of a ResNet-18 step comes out 7% off, with no error. ``cross_entropy_loss`` drops
# ``label_smoothing``. So a program calling such an op with another value than the one the
# exporter assumes is refused when it is compiled, before and after the exporter's own
# decompositions (which may write an op of the program as one of these);
# ``decompositions="core_aten"`` writes batch norm and the losses as means, variances, sums
# and products, which export faithfully. The table maps each op to the argument the exporter
# ignores and the value it assumes.
_IGNORED_ARGUMENTS: dict[Any, tuple[str, object]] = {
    torch.ops.aten.native_batch_norm.default: ("training", False),
    torch.ops.aten._native_batch_norm_legit.default: ("training", False),
    torch.ops.aten._native_batch_norm_legit.no_stats: ("training", False),
    torch.ops.aten._native_batch_norm_legit_functional.default: ("training", False),
    torch.ops.aten.cross_entropy_loss.default: ("label_smoothing", 0.0),
}


def _argument(node: fx.Node, name: str) -> Any:
    """The value of ``node``'s argument ``name`` (its schema's default when not given)."""
    schema = node.target._schema  # type: ignore[union-attr]
    for i, argument in enumerate(schema.arguments):
        if argument.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, argument.default_value)
    raise AssertionError(f"expected {schema.name} to have an argument {name!r}")


def _ignored_arguments(program: ExportedProgram) -> str | None:
    """Note [ONNX functions that ignore an argument]."""
    ignored = []
    for node in base.calls(program):
        if node.target in _IGNORED_ARGUMENTS:
            name, assumed = _IGNORED_ARGUMENTS[node.target]
            value = _argument(node, name)
            if value != assumed:
                ignored.append((node, f"{name}={value!r}, which it takes as {assumed!r}"))
    if not ignored:
        return None
    lines = "\n".join(f"{base.describe([n])}: {why}" for n, why in ignored[: base.SHOWN])
    return (
        "calls ops whose ONNX function ignores an argument"
        f" (Note [ONNX functions that ignore an argument]):\n{lines}\n"
        "  Capture with decompositions='core_aten', which writes these ops as ops the"
        " exporter computes (for batch norm, model.eval() also runs), or run the program"
        " with torch"
    )


# What ONNX Runtime would run unlike torch, in the program and in the exporter's
# (``base.Backend.refuse``; random ops are every backend's check).
_UNFAITHFUL = (_filler_outputs, _ignored_arguments)


def compile_program(program: ExportedProgram) -> OrtProgram:
    """``program`` (a flat program of ``traced.export(flat=True)``) as an ONNX Runtime session.

    >>> import torch, aotgrad
    >>> from aotgrad.backends.onnxruntime import compile_program
    >>> lin = torch.nn.Linear(3, 2)
    >>> programs = aotgrad.trace(lambda x: lin(x).sum(), torch.ones(4, 3)).export(flat=True)
    >>> run = compile_program(programs.forward)
    >>> loss, *saved = run(*programs.lifted, torch.ones(4, 3))
    >>> torch.testing.assert_close(loss, lin(torch.ones(4, 3)).sum().detach())
    """
    kind = base.program_kind(program)
    inputs, outputs = ORT.user_specs(program, kind)
    ORT.refuse(program, kind, *_UNFAITHFUL)
    onnx_program = _export(program, kind)
    # What the exporter translated: its decompositions may write an op as a refused one.
    ORT.refuse(onnx_program.exported_program, kind, *_UNFAITHFUL, _broadcasting_copies)
    feeds = _feed_names(onnx_program, inputs, kind)
    session = _session(onnx_program.model_proto, kind)
    _check_session(session, feeds, inputs, outputs, kind)
    return OrtProgram(session, kind, inputs, outputs, feeds)


class OrtProgram(base.CompiledProgram):
    """One program compiled by ONNX Runtime: call it with the program's inputs in order; it
    returns the program's outputs in order, as CPU tensors."""

    def __init__(
        self,
        session: Any,
        kind: str,
        inputs: Sequence[base.TensorSpec],
        outputs: Sequence[base.TensorSpec],
        feeds: Sequence[str | None],
    ) -> None:
        super().__init__(ORT, kind, inputs, outputs)
        self.session = session
        # The session input each program input feeds (None: the model does not read it).
        self.feeds = tuple(feeds)
        self._output_names = [o.name for o in session.get_outputs()]

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.check_inputs(args)
        feeds: dict[str, Any] = {}
        for spec, name, value in zip(self.inputs, self.feeds, args, strict=True):
            _check_value(value, spec, f"{self.kind} program input", CallError)
            if name is not None:
                feeds[name] = base.to_numpy(value)
        try:
            results = self.session.run(self._output_names, feeds)
        except Exception as error:  # ONNX Runtime raises its own exception types
            raise BackendError(
                f"{ORT.key}: running the {self.kind} program failed: {error}\n"
                "Run the program with torch (programs.forward.module()) to compare, and report"
                " the op ONNX Runtime names above"
            ) from error
        self.check_results(results)
        tensors = []
        for spec, result in zip(self.outputs, results, strict=True):
            tensor = torch.from_numpy(result)
            _check_value(tensor, spec, f"{ORT.key}: the {self.kind} program's output", BackendError)
            tensors.append(tensor)
        return tuple(tensors)


# The loggers of the exporter and its optimizer: they warn about their own passes ("Skipped
# deduplication of initializer 'add'"), nothing the user's code can act on.
_EXPORTER_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter prints its progress, warns about torch's own deprecations and logs its
    passes' decisions: none of it is the user's business. Its errors still raise."""
    loggers = [logging.getLogger(name) for name in _EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            # Constant folding evaluates ops in NumPy, which warns on log(0) and the like.
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _export(program: ExportedProgram, kind: str) -> Any:
    """``torch.onnx.export`` of ``program``; an op it cannot take is a ``BackendError``."""
    try:
        with _quiet():
            return torch.onnx.export(_decompose(program), dynamo=True, verbose=False, optimize=True)
    except Exception as error:  # the exporter raises its own errors, and any of torch's
        raise BackendError(_export_failure(program, kind, error)) from error


# The exporter's messages name the node it failed on: "...call_function[target=torch.ops.
# aten.kthvalue.default]..." or "No ONNX function found for <OpOverload(op='aten.kthvalue',
# overload='default')>".
_TARGET = re.compile(r"target=torch\.ops\.([\w.]+)")
_OVERLOAD = re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _failed_ops(error: BaseException) -> list[str]:
    """The aten ops the exporter's error (and its causes) name, in the order they appear."""
    names: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        names += [f"{op}.{overload}" for op, overload in _OVERLOAD.findall(text)]
        names += _TARGET.findall(text)
        current = current.__cause__ or current.__context__
    return list(dict.fromkeys(names))


def _reason(error: BaseException) -> str:
    """The innermost line of the exporter's "Exception summary", or the error itself."""
    text = _ANSI.sub("", str(error))
    summary = text.partition("## Exception summary")[2]
    lines = [line for line in summary.splitlines() if line.startswith("<class ")]
    return lines[0] if lines else text.strip().splitlines()[0] if text.strip() else repr(error)


def _export_failure(program: ExportedProgram, kind: str, error: BaseException) -> str:
    ops = _failed_ops(error)
    if ops:
        nodes = [n for n in base.calls(program) if op_name(n.target) in ops]
        found = {op_name(n.target) for n in nodes}
        named = base.describe(nodes)
        missing = [op for op in ops if op not in found]
        if missing:
            named += "".join(
                f"\n  {op} (made by the exporter's own decomposition of the program)"
                for op in missing
            )
        what = f"could not take op(s):\n{named}"
    else:
        what = "failed"
    return (
        f"{ORT.key}: torch.onnx.export of the {kind} program {what}\n"
        f"  exporter: {_reason(error)}\n"
        "Capture with decompositions='core_aten' (the exporter knows Core ATen best), rewrite"
        " the code on that line with other ops, or run the program with torch or another"
        " backend"
    )


def _feed_names(
    onnx_program: Any, inputs: Sequence[base.TensorSpec], kind: str
) -> list[str | None]:
    """The ONNX model's name of each of the program's inputs, None where the model has no
    such input (Note [ONNX Runtime inputs by name])."""
    exported = onnx_program.exported_program
    if exported is None:
        raise AssertionError("expected torch.onnx.export to keep the program it translated")
    theirs = ORT.specs(exported, kind, "input")
    if len(theirs) != len(inputs):
        raise BackendError(
            f"{ORT.key}: torch.onnx.export changed the {kind} program's inputs: expected"
            f" {len(inputs)} ({', '.join(map(str, inputs))}), got {len(theirs)}"
            f" ({', '.join(map(str, theirs))})"
        )
    for mine, their in zip(inputs, theirs, strict=True):
        if (mine.shape, mine.dtype) != (their.shape, their.dtype):
            raise BackendError(
                f"{ORT.key}: torch.onnx.export changed the {kind} program's input {mine}:"
                f" expected its input in that place to match, got {their}"
            )
    position = {their.name: i for i, their in enumerate(theirs)}
    feeds: list[str | None] = [None] * len(inputs)
    for value in onnx_program.model.graph.inputs:
        # The exporter keeps the placeholder each ONNX input was made from (``_core.py``,
        # ``_handle_placeholder_node``); the optimizer may rename the input, not replace it.
        node = value.meta.get("node")
        i = position.get(node.name) if isinstance(node, fx.Node) else None
        if i is None or feeds[i] is not None:
            raise BackendError(
                f"{ORT.key}: the ONNX model of the {kind} program has an input {value.name!r}"
                " that aotgrad cannot trace to one of the program's"
                f" ({', '.join(map(str, inputs))}); it cannot be fed"
            )
        feeds[i] = value.name
    return feeds


def _session(model: Any, kind: str) -> Any:
    """An ONNX Runtime session on the CPU for ``model``, as quiet as the exporter."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings name nodes, not the user's code
    options.intra_op_num_threads = torch.get_num_threads()
    try:
        return onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as error:  # ONNX Runtime raises its own exception types
        raise BackendError(
            f"{ORT.key}: ONNX Runtime could not load the {kind} program: {error}\n"
            f"{_onnx_node_origin(model, str(error))}"
            "Run the program with torch or another backend"
        ) from error


# "... node with name 'node_Add_3' ..." or "Node (node_unsqueeze) Op (Unsqueeze) ...".
_ORT_NODE = re.compile(r"node with name '([^']*)'|Node \(([^)]*)\)")


def _onnx_node_origin(model: Any, message: str) -> str:
    """The aten node an ONNX node named in ``message`` was made from, as a line, or ""."""
    names = {name for pair in _ORT_NODE.findall(message) for name in pair if name}
    lines = []
    for node in model.graph.node:
        if node.name in names:
            props = {p.key: p.value for p in node.metadata_props}
            fx_node = props.get("pkg.torch.onnx.fx_node")
            if fx_node:
                lines.append(f"  ONNX node {node.name} ({node.op_type}) made from {fx_node}\n")
    return "".join(lines)


def _check_session(
    session: Any,
    feeds: Sequence[str | None],
    inputs: Sequence[base.TensorSpec],
    outputs: Sequence[base.TensorSpec],
    kind: str,
) -> None:
    """The session's inputs are the ``feeds`` with their specs; its outputs the program's."""
    wanted = {name: spec for name, spec in zip(feeds, inputs, strict=True) if name is not None}
    got_inputs = session.get_inputs()
    if sorted(a.name for a in got_inputs) != sorted(wanted):
        raise BackendError(
            f"{ORT.key}: the ONNX Runtime session of the {kind} program takes inputs"
            f" {sorted(a.name for a in got_inputs)}, expected the ONNX model's {sorted(wanted)}"
        )
    for arg in got_inputs:
        _check_node_arg(arg, wanted[arg.name], f"input {arg.name!r}", kind)
    got = session.get_outputs()
    if len(got) != len(outputs):
        raise BackendError(
            f"{ORT.key}: the ONNX model of the {kind} program returns {len(got)} output(s),"
            f" expected the program's {len(outputs)} ({', '.join(map(str, outputs))})"
        )
    for arg, spec in zip(got, outputs, strict=True):
        _check_node_arg(arg, spec, f"output {arg.name!r}", kind)


def _check_node_arg(arg: Any, spec: base.TensorSpec, what: str, kind: str) -> None:
    """The session's declared type and shape of ``arg`` are ``spec``'s (unknown dims pass)."""
    dims = list(arg.shape)
    same_shape = len(dims) == len(spec.shape) and all(
        not isinstance(d, int) or d == s for d, s in zip(dims, spec.shape, strict=True)
    )
    if arg.type != _ORT_TYPES[spec.dtype] or not same_shape:
        raise BackendError(
            f"{ORT.key}: the ONNX model of the {kind} program declares its {what} as"
            f" {arg.type}{dims}, expected the program's {spec}"
        )


def _check_value(value: object, spec: base.TensorSpec, what: str, error: type[Exception]) -> None:
    if not isinstance(value, torch.Tensor):
        raise error(
            f"{what} {spec.name}: expected a tensor ({spec.layout}), got {type(value).__name__}"
        )
    if value.dtype != spec.dtype or tuple(value.shape) != spec.shape:
        raise error(
            f"{what} {spec.name}: expected {spec.layout}, got"
            f" {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        )
