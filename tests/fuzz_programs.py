"""Random small programs checked against eager: the differential fuzzer's generator and checker.

A :class:`Program` is a few input tensors (fresh, passed twice, or views of one base passed
together) and a list of steps over them (views, in-place ops, metadata mutation, custom
``autograd.Function``s, one- and two-input, ``no_grad``/``enable_grad`` regions, random ops),
returning some of its values. Some of its base tensors are also *state*: ``Model`` holds them
as parameters (those requiring grad) and buffers (the rest), and a loss reaches them through
a global or closed-over ``Model`` or as global tensors. ``repr(program)`` is the program's
file, a runnable script that checks itself, so a shrunk failure prints as its own repro.

:func:`check` runs a program eagerly (a program eager rejects is discarded), then in every
idiom a user calls aotgrad in:

- ``aot``: ``aot_function`` over arguments; ``dynamic`` (``dynamic=True``) and ``twice`` (one
  compiled function called twice) on a quarter of the programs each: with
  ``aotgrad.testing.verify``;
- ``module``: ``aot_module(Model(...))``; ``global_module``, ``closure_module``,
  ``global_tensors``: ``aot_function`` of the loss over the state (one of them per program);
- ``trace``: ``aotgrad.trace`` then the ``Traced`` called on fresh inputs of the same
  specialization; ``trace_other``: on inputs of another shape or dtype (eager's result or an
  ``AotgradError``); ``trace_module``: ``trace(Model(...))`` then fresh arguments;
- ``compile``: ``torch.compile(backend="aotgrad")`` of the loss over the state (a quarter of
  the programs);
- each with ``create_graph=True`` on a fifth of the programs (second-order gradients).

The idioms but the first three run ``fuzz_idioms.run_idiom``, which compares every gradient
(parameters', buffers', global tensors') itself. A documented refusal (an
``aotgrad.errors.AotgradError``) is acceptable; a mismatch or any other exception is a
:class:`FuzzFailure`.

Feature switch
--------------
Every step carries feature names (``FEATURES``). Features that still trigger known, unfixed
defects are in ``KNOWN_BAD`` (feature -> issue item) and are *not generated* by default, so the
bounded run in ``make test`` passes deterministically. Enable them when their fix merges, by
deleting the entry from ``KNOWN_BAD``, or for one run with the environment variable
``AOTGRAD_FUZZ_FEATURES`` (``all``, or a comma list of extra features to enable, e.g.
``AOTGRAD_FUZZ_FEATURES=random_strided,function_returns_input make fuzz``). ``make fuzz``
enables all features (``HYPOTHESIS_PROFILE=long``).

Hypothesis profiles (registered here): ``fuzz_ci`` (bounded, derandomized, the default) and
``long`` (many thousand examples, random seed, prints every failure shrunk).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch.autograd.function import once_differentiable
from torch.testing._internal.two_tensor import TwoTensor

import aotgrad
import fuzz_idioms
from aotgrad import testing
from aotgrad.capture.tracing.tracers import DirectTracerBugWarning
from aotgrad.errors import AotgradError
from fuzz_idioms import FuzzFailure, error_signature, mismatch_signature, short_traceback

# torch's fake-tensor logger prints every failed meta kernel (issue item 19): keep runs readable.
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

# --- feature switch ---------------------------------------------------------------------------

FEATURES = frozenset(
    {
        "view",  # view/reshape/t/transpose/permute/expand/narrow/slice/unsqueeze/squeeze/...
        "multi_view",  # unbind/split outputs
        "as_strided",
        "compute",  # out-of-place math
        "inplace",  # add_, mul_, copy_, zero_, clamp_, relu_, index_put_, masked_fill_
        "inplace_input",  # an in-place op whose target shares memory with an input
        "metadata",  # t_, transpose_, unsqueeze_, squeeze_, as_strided_, resize_
        "metadata_input",  # metadata mutation of an input (or a view of one)
        "metadata_aliased_input",  # ... of an input that shares memory with another input
        "alias_inputs",  # the same tensor twice, views of one base passed together
        "function",  # custom autograd.Function returning a new tensor
        "function_returns_input",  # ... returning its input as is (issue item 6)
        "function_view",  # ... returning a view of its input
        "function_dirty",  # ... mutating its input with mark_dirty
        "function_nondiff",  # ... with a non-differentiable output
        "grad_mode",  # no_grad / enable_grad regions
        "call_under_no_grad",  # the compiled function is called under no_grad
        "requires_grad_under_no_grad",  # ... with requires_grad_() inside the function
        "requires_grad_",  # requires_grad_() inside the function
        "random",  # dropout, rand_like, randn_like, bernoulli on contiguous tensors
        "random_strided",  # ... on non-contiguous tensors
        "return_alias",  # returning inputs, views of inputs, or one value twice
        "nograd_view",  # a view made in a no_grad region
        "reshape_size1_strides",  # reshape of a non-contiguous tensor to a view with size-1 dims
        "inplace_overlapping",  # an in-place op through an expanded (self-overlapping) view
        "equal_view_inputs",  # two distinct input objects that are equal views of one base
        "return_nograd_alias",  # returning a value and a detach()/no_grad view of it
        "size1_strided_input",  # a non-contiguous input with a size-1 dimension
        "dynamic",  # aot_function(dynamic=True)
        "dynamic_inplace_clamp",  # ... with clamp_/relu_ (issue item 4)
        "dynamic_resize",  # ... with resize_
        "compile",  # torch.compile(backend="aotgrad")
        "compile_grad_mode",  # ... with a no_grad/enable_grad region (Dynamo graph breaks)
        "compile_requires_grad_",  # ... with requires_grad_() (Dynamo replays it after its graph)
        "function_binary",  # a two-input custom Function (both styles, needs_input_grad, ...)
        "function_once",  # ... with a once_differentiable backward
        "function_no_materialize",  # ... with set_materialize_grads(False)
        "function_param",  # a custom Function applied to a parameter itself (MyFn.apply(x, self.w))
        "module",  # Model's parameters and buffers through aot_module (fuzz_idioms)
        "global",  # a loss over a global or closed-over Model, or global tensors: aot_function
        "trace",  # trace, then the Traced called on fresh inputs of the same specialization
        "trace_module",  # ... trace(Model) likewise
        "trace_other_spec",  # ... called on inputs of another shape or dtype: eager's or a refusal
        "create_graph",  # gradients with create_graph=True, differentiated again
        "trace_under_no_grad",  # a Traced called under no_grad
        "once_differentiable_create_graph",  # create_graph=True over a once_differentiable backward
        "create_graph_aliased_inputs",  # create_graph=True with inputs that share memory
        "requires_grad_intermediate",  # requires_grad_() on a value the function made
        "masked_fill_strided",  # masked_fill_ on a non-contiguous value
        "function_backward_mutation",  # a custom Function whose backward changes a saved input
        "set_",  # x.set_(y) on a value the function made
        "set_input",  # ... on an input or a view of one (issue 39 setx)
        "data_assign",  # x.data = y
        "touch_outputs",  # the caller changes every output in place after the call (mul_(1))
        "multi_view_touched",  # ... an output of unbind/split among them (issue 39 mov)
        "subclass",  # TwoTensor arguments (torch.testing._internal.two_tensor)
        "dtensor",  # DTensor arguments (Replicate or Shard(0)) on a one-rank cpu mesh
        "dtensor_create_graph",  # create_graph=True with DTensor arguments
        "subclass_metadata_input",  # t_/transpose_/... of a TwoTensor input (issue 39 subcls)
        "subclass_view_returned",  # a view of a TwoTensor input returned
        "compile_set_",  # torch.compile with set_() or a .data assignment
        "resize_strided_aliased_input",  # resize_() of a strided input another input aliases
        "subclass_create_graph",  # create_graph=True with TwoTensor arguments
        "subclass_returned_twice",  # one TwoTensor value returned more than once
        "enable_grad_view_under_no_grad",  # called under no_grad: enable_grad over a view
    }
)

# Features that trigger known defects: not generated unless enabled (see the module docstring).
KNOWN_BAD: dict[str, str] = {
    "once_differentiable_create_graph": "NEW F21: create_graph=True differentiates a"
    " once_differentiable backward (eager's first-order gradient does not require grad)",
    "trace_under_no_grad": "NEW F20: a Traced called under no_grad returns a view of an input"
    " with a grad_fn (eager's is a leaf), and raises a raw RuntimeError where it replays an"
    " in-place op on a view of a leaf (eager runs it)",
    "masked_fill_strided": "NEW F23: an intermediate of a transposed input changed by masked_fill_"
    " and returned is contiguous (eager keeps the input's layout)",
    "requires_grad_intermediate": "F24: v = x * 2; v.requires_grad_(True); return v: refused"
    " (UnsupportedOutputError, Note [Leaf outputs]); eager returns a leaf a compiled function"
    " cannot",
    "dtensor_create_graph": "NEW F35: create_graph=True with DTensor arguments: a second-order"
    " gradient's local strides are not eager's (a0.t()), and aotgrad's backward calls as_strided,"
    " which DTensor refuses (eager runs it)",
    "compile_requires_grad_": "NEW F13: torch.compile, requires_grad_() on a mutated input viewed",
    "requires_grad_under_no_grad": "NEW F15: requires_grad_() on a no_grad view of an input",
}

# Known-bad *differences* no feature isolates: a failure whose signature is listed is tolerated
# unless its name is enabled like a feature (AOTGRAD_FUZZ_FEATURES=<name>).
KNOWN_BAD_SIGNATURES: dict[str, tuple[str, str]] = {
    "F16": (
        "mismatch: output: requires_grad True != eager False",
        "NEW F16: under no_grad, a custom Function's output of an aliased input that the function"
        " then makes require grad requires grad",
    ),
    "F18": (
        "mismatch: output: is_leaf True != eager False",
        "NEW F18: a1.t_(); a1.requires_grad_(True) on an input that is a view (b[1:]), then"
        " a1.view(-1) returned: aotgrad's output is a leaf, eager's a view of a1",
    ),
    "F19": (
        "mismatch: grad of: requires_grad False != eager True; second-order grad of: None != eager"
        " a tensor",
        "NEW F19: create_graph=True, an empty input returned as a view (a.view(-1)): its"
        " first-order gradient does not require grad (eager's does)",
    ),
    "F38": (
        "mismatch: input: is_leaf True != eager False",
        "NEW F38: a0.t_(); a0.requires_grad_(True) on an input another input views (b, b[1:]),"
        " the backward reading a0: that view is a leaf after the call (eager's is a view of b)",
    ),
}


def tolerated_signatures() -> set[str]:
    extra = os.environ.get("AOTGRAD_FUZZ_FEATURES", "")
    if extra.strip() == "all":
        return set()
    on = {name.strip() for name in extra.split(",")}
    return {sig for name, (sig, _) in KNOWN_BAD_SIGNATURES.items() if name not in on}


def enabled_features() -> frozenset[str]:
    extra = os.environ.get("AOTGRAD_FUZZ_FEATURES", "")
    if extra.strip() == "all":
        return FEATURES
    on = {name.strip() for name in extra.split(",") if name.strip()}
    unknown = on - FEATURES - set(KNOWN_BAD_SIGNATURES)
    if unknown:
        raise ValueError(f"AOTGRAD_FUZZ_FEATURES: unknown features {sorted(unknown)}")
    return frozenset(FEATURES - (set(KNOWN_BAD) - on))


settings.register_profile(
    "fuzz_ci",
    max_examples=int(os.environ.get("AOTGRAD_FUZZ_EXAMPLES", "80")),
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("AOTGRAD_FUZZ_EXAMPLES", "5000")),
    derandomize=False,
    deadline=None,
    database=None,
    print_blob=True,
    report_multiple_bugs=True,
    suppress_health_check=list(HealthCheck),
)


def fuzz_settings() -> settings:
    return settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fuzz_ci"))


# --- custom autograd.Functions the programs call ------------------------------------------------
# Backwards scale by 2 or 3 so a graph that skips the Function's own backward is caught.


class NewTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class ReturnsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ReturnsView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 3


class MarksDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NonDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        return x * 3, mask

    @staticmethod
    def backward(ctx, g, g_mask):
        return g * 3


# Two-input Functions, applied to a value and a parameter, buffer or global tensor directly
# (``MulSum.apply(v0, self.p0)``) or to any two values: both styles (``forward(ctx, ...)`` and
# ``setup_context``), ``needs_input_grad``, ``mark_non_differentiable``,
# ``once_differentiable``, ``set_materialize_grads(False)``. Shapes differ: ``w`` enters reduced.


class MulSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w.sum()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w.sum() * 2 if ctx.needs_input_grad[0] else None
        gw = (g * x).sum().expand(w.shape) * 3 if ctx.needs_input_grad[1] else None
        return gx, gw


class AddMeanMask(torch.autograd.Function):
    @staticmethod
    def forward(x, w):
        out = x + w.mean()
        return out, (out > 0).to(out.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, w = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(w)

    @staticmethod
    def backward(ctx, g, g_mask):
        (w,) = ctx.saved_tensors
        gx = g * 2 if ctx.needs_input_grad[0] else None
        gw = (g.sum() * 3 / w.numel()).expand(w.shape) if ctx.needs_input_grad[1] else None
        return gx, gw


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w.mean()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w.mean() * 2, ((g * x).sum() * 3 / w.numel()).expand(w.shape)


class NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(x, w):
        return x * 2, w * 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, gx, gw):
        # An unused output's cotangent is None (not zeros): its input gets None.
        return (
            None if gx is None or not ctx.needs_input_grad[0] else gx * 2,
            None if gw is None or not ctx.needs_input_grad[1] else gw * 5,
        )


class MutatesSaved(torch.autograd.Function):
    """Its backward changes the saved input in place: eager's caller sees it when it runs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return g * 3


FUNCTIONS = {
    "MutatesSaved": MutatesSaved,
    "NewTensor": NewTensor,
    "ReturnsInput": ReturnsInput,
    "ReturnsView": ReturnsView,
    "MarksDirty": MarksDirty,
    "NonDifferentiable": NonDifferentiable,
    "MulSum": MulSum,
    "AddMeanMask": AddMeanMask,
    "OnceDifferentiable": OnceDifferentiable,
    "NoMaterialize": NoMaterialize,
}
FUNCTION_FEATURES = {
    "MutatesSaved": "function_backward_mutation",
    "NewTensor": "function",
    "ReturnsInput": "function_returns_input",
    "ReturnsView": "function_view",
    "MarksDirty": "function_dirty",
    "NonDifferentiable": "function_nondiff",
    "MulSum": "function_binary",
    "AddMeanMask": "function_binary",
    "OnceDifferentiable": "function_once",
    "NoMaterialize": "function_no_materialize",
}
BINARY_FUNCTIONS = ("MulSum", "AddMeanMask", "OnceDifferentiable", "NoMaterialize")

# --- programs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One line of the program: ``target = expr`` or a bare statement, maybe in a region."""

    expr: str
    target: str | None = None
    region: str | None = None  # "no_grad" or "enable_grad"
    features: frozenset[str] = frozenset()

    def lines(self) -> list[str]:
        line = self.expr if self.target is None else f"{self.target} = {self.expr}"
        if self.region is None:
            return [line]
        return [f"with torch.{self.region}():", f"    {line}"]


@dataclass(frozen=True)
class Base:
    """A base tensor the arguments view: ``torch.randn(shape)``, maybe transposed."""

    shape: tuple[int, ...]
    requires_grad: bool
    transposed: bool = False
    two: bool = False  # a TwoTensor of two such tensors (tensor-subclass inputs)
    placement: str | None = None  # a DTensor of such a tensor: "Replicate()" or "Shard(0)"

    @property
    def subclass(self) -> bool:
        return self.two or self.placement is not None

    def source(self, other: str | None = None) -> str:
        """Its source; ``other``: another specialization ("shape": each size + 1, "dtype")."""
        if self.subclass:
            plain = Base(self.shape, False, self.transposed).source(other)
            grad = ".requires_grad_()" if self.requires_grad else ""
            if self.placement is not None:
                return f"distribute_tensor({plain}, one_rank_mesh(), [{self.placement}]){grad}"
            return f"TwoTensor({plain}, {plain}){grad}"
        shape = tuple(n + 1 for n in self.shape) if other == "shape" else self.shape
        dtype = ", dtype=torch.float64" if other == "dtype" else ""
        if self.transposed:
            sizes = ", ".join(map(str, reversed(shape)))
            src = f"torch.randn({sizes}{dtype}).permute{tuple(reversed(range(len(shape))))}"
            return src + (".requires_grad_()" if self.requires_grad else "")
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"torch.randn({', '.join(map(str, shape))}{dtype}{grad})"


@dataclass(frozen=True)
class Program:
    bases: tuple[Base, ...]
    args: tuple[str, ...]  # source of each argument, over the bases b0, b1, ...
    steps: tuple[Step, ...]
    returns: tuple[str, ...]
    # Besides "aot": "dynamic", "twice", "compile", and fuzz_idioms.STATE_IDIOMS.
    modes: tuple[str, ...]
    under_no_grad: bool = False
    features: frozenset[str] = field(default=frozenset(), compare=False)
    # Bases held as state by the module/global idioms: parameters (those requiring grad) and
    # buffers of ``Model``, or the global tensors ``P<j>``. The other bases stay arguments.
    state: tuple[int, ...] = ()
    holder: str = "global_module"  # how the loss reaches the state (fuzz_idioms.HOLDERS)
    other: str = "shape"  # trace_other's specialization: "shape" or "dtype"
    create_graph: bool = False  # gradients taken with create_graph=True, and differentiated
    touch_outputs: bool = False  # the caller changes every output in place after the call

    @property
    def free(self) -> tuple[int, ...]:
        """The arguments over bases that are not state: the module's forward arguments."""
        return tuple(i for i, a in enumerate(self.args) if _base_of(a) not in self.state)

    def _body(self) -> list[str]:
        body = [line for step in self.steps for line in step.lines()]
        body.append(f"return {', '.join(self.returns)}" + ("," if len(self.returns) == 1 else ""))
        return body

    def function_source(self) -> str:
        params = ", ".join(f"a{i}" for i in range(len(self.args)))
        return "\n".join([f"def fn({params}):", *("    " + line for line in self._body())])

    def _over_state(self, prefix: str) -> list[str]:
        """``a<i> = <view of the state>`` for the arguments over state bases."""
        return [
            f"a{i} = " + re.sub(r"\bb(\d+)\b", rf"{prefix}\1", a)
            for i, a in enumerate(self.args)
            if i not in self.free
        ]

    def state_source(self) -> str:
        """``Model`` (state bases as parameters and buffers) and the loss over it."""
        params = ", ".join(f"a{i}" for i in self.free)
        b = ", ".join(f"b{j}" for j in self.state)
        init = [
            f"self.p{j} = torch.nn.Parameter(b{j})"
            if self.bases[j].requires_grad
            else f'self.register_buffer("p{j}", b{j})'
            for j in self.state
        ]
        forward = self._over_state("self.p") + self._body()
        model = [
            "class Model(torch.nn.Module):",
            f"    def __init__(self, {b}):",
            "        super().__init__()",
            *("        " + line for line in init),
            "",
            f"    def forward(self, {params}):".replace("(self, )", "(self)"),
            *("        " + line for line in forward),
        ]
        if self.holder == "global_module":
            loss = [
                "model = None  # the global module loss reads (each run sets its own)",
                "",
                "",
                f"def loss({params}):",
                f"    return model({params})",
            ]
        elif self.holder == "closure_module":
            loss = [
                "def make_loss(model):",
                f"    def loss({params}):",
                f"        return model({params})",
                "",
                "    return loss",
            ]
        else:
            globals_ = " = ".join(f"P{j}" for j in self.state)
            loss = [
                f"{globals_} = None  # the global tensors loss reads (each run sets its own)",
                "",
                "",
                f"def loss({params}):",
                *("    " + line for line in self._over_state("P") + self._body()),
            ]
        return "\n".join([*model, "", "", *loss])

    def inputs_source(self) -> str:
        """``make_inputs(seed, other)``: the bases and the arguments over them."""
        lines = ["def make_inputs(seed=0, other=None):", "    torch.manual_seed(seed)"]
        made = [f"b{i} = {base.source()}" for i, base in enumerate(self.bases)]
        if "trace_other" in self.modes:
            lines.append(f'    if other == "{self.other}":')
            lines += [
                f"        b{i} = {base.source(self.other)}" for i, base in enumerate(self.bases)
            ]
            lines.append("    else:")
            lines += ["        " + line for line in made]
        else:
            lines += ["    " + line for line in made]
        bases = _tuple_source([f"b{i}" for i in range(len(self.bases))])
        lines.append(f"    return {bases}, {_tuple_source(self.args)}")
        return "\n".join(lines)

    def script(self) -> str:
        """The program as a runnable file: it checks itself when run as a script."""
        idioms = ", ".join(repr(m) for m in ("aot", *self.modes))
        lines = [
            "import torch",
            "import torch.nn.functional as F",
            "from torch.testing._internal.two_tensor import TwoTensor",
            *(
                ["from torch.distributed.tensor import Replicate, Shard, distribute_tensor"]
                if any(b.placement for b in self.bases)
                else []
            ),
            "",
            f"from fuzz_programs import {', '.join(sorted(FUNCTIONS))}",
            *(
                ["from fuzz_programs import one_rank_mesh"]
                if any(b.placement for b in self.bases)
                else []
            ),
            "",
            f"STATE = {self.state!r}  # bases held by Model (parameters, buffers) or as globals P<j>",
            f"FREE = {self.free!r}  # the arguments Model.forward and loss take",
            "",
            "",
            self.function_source(),
            "",
            "",
        ]
        if self.state:
            lines += [self.state_source(), "", ""]
        lines += [
            self.inputs_source(),
            "",
            "",
            'if __name__ == "__main__":  # compare with eager: fuzz_idioms.run_idiom for each idiom',
            "    import fuzz_programs",
            "",
            f"    fuzz_programs.replay(__file__, [{idioms}], holder={self.holder!r},"
            f" other={self.other!r}, create_graph={self.create_graph},"
            f" under_no_grad={self.under_no_grad}, touch_outputs={self.touch_outputs})",
        ]
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return "\n" + self.script()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # Hypothesis prints the runnable script, not the fields

    def path(self) -> str:
        """The script, written once to a real file (tracebacks and source lines work)."""
        src = self.script()
        digest = hashlib.sha1(src.encode()).hexdigest()[:16]
        path = os.path.join(_program_dir(), f"prog_{digest}.py")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(src)
        return path

    def make_namespace(self) -> dict[str, Any]:
        return load(self.path())

    def make_function(self) -> Callable[..., Any]:
        return self.make_namespace()["fn"]

    def make_args(self, seed: int = 0, other: str | None = None) -> tuple[Any, ...]:
        namespace: dict[str, Any] = {"torch": torch, "TwoTensor": TwoTensor}
        if any(b.placement for b in self.bases):
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            namespace.update(
                Replicate=Replicate,
                Shard=Shard,
                distribute_tensor=distribute_tensor,
                one_rank_mesh=one_rank_mesh,
            )
        exec(self.inputs_source(), namespace)
        with _fork_rng():
            return namespace["make_inputs"](seed, other)[1]


DTENSOR_ONE_IN = 10  # one program in so many (of those without TwoTensors) takes DTensors
_MESH: list[Any] = []


def one_rank_mesh() -> Any:
    """A 1-D cpu DeviceMesh over a one-rank gloo group, made once per process and never torn
    down (DTensor arguments of earlier programs keep pointing at it). A group made by another
    test in this process is reused."""
    if not _MESH:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _MESH.append(DeviceMesh("cpu", [0]))
    return _MESH[0]


def _dtensor_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available())


def _tuple_source(items: Any) -> str:
    return f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _base_of(arg: str) -> int:
    return int(re.match(r"b(\d+)", arg).group(1))  # type: ignore[union-attr]


def load(path: str) -> dict[str, Any]:
    """A fresh namespace of a program file (each world gets its own globals)."""
    with open(path) as f:
        src = f.read()
    namespace: dict[str, Any] = {"__name__": "fuzz_program", "__file__": path}
    exec(compile(src, path, "exec"), namespace)
    return namespace


def replay(path: str, idioms: list[str], **options: Any) -> None:
    """Run a program file in each idiom, as the fuzzer does; print what each gave."""
    program_namespace = load(path)
    for idiom in idioms:
        try:
            if idiom in VERIFY_MODES:
                _verify_mode(
                    program_namespace["fn"],
                    lambda: program_namespace["make_inputs"]()[1],
                    idiom,
                    options["create_graph"],
                    options["under_no_grad"],
                )
            else:
                fuzz_idioms.run_idiom(lambda: load(path), idiom, **options)
            print(f"{idiom}: match")
        except AotgradError as err:
            print(f"{idiom}: refused: {type(err).__name__}: {str(err).splitlines()[0]}")
        except fuzz_idioms.EagerFails as err:
            print(f"{idiom}: eager fails: {err}")
        except FuzzFailure as failure:
            print(f"{idiom}: FAILS {failure.signature}\n{failure.detail}")


def _program_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"aotgrad_fuzz_{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _fork_rng():
    state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


# --- generation ---------------------------------------------------------------------------------
# The generator runs every candidate step on detached copies of the inputs (no grad): a step
# eager cannot run (bad shape, out of bounds) is dropped at once, and each value's shape,
# contiguity and memory sharing with the inputs are known to the next step.


class _Env:
    def __init__(self, program_args: tuple[Any, ...]):
        copies = program_args  # fresh from make_args: changing them changes nothing else
        detached: dict[int, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        for i, t in enumerate(copies):
            if id(t) not in detached:
                detached[id(t)] = t.detach()
            self.values[f"a{i}"] = detached[id(t)]
        self.inputs = [self.values[f"a{i}"] for i in range(len(copies))]
        self.count = 0
        # Values made without grad (no_grad region, detach, or derived from such a value).
        self.nograd: set[str] = set()
        # Arguments that are a parameter itself in the module/global idioms (set by programs()).
        self.params: set[str] = set()
        # Outputs of unbind/split, and views of them: eager refuses to change them in place.
        self.multi_views: set[str] = set()

    def try_step(self, step: Step) -> bool:
        namespace = {"torch": torch, "F": F, "TwoTensor": TwoTensor, **FUNCTIONS, **self.values}
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if step.target is None:
                    exec(step.expr, namespace)
                else:
                    value = eval(step.expr, namespace)
                    if not isinstance(value, torch.Tensor):
                        return False
                    self.values[step.target] = value
                    operands = set(re.findall(r"\b[av]\d+\b", step.expr))
                    if (
                        step.region == "no_grad"
                        or ".detach()" in step.expr
                        or operands & self.nograd
                    ):
                        self.nograd.add(step.target)
                    if "multi_view" in step.features or (
                        "view" in step.features and operands & self.multi_views
                    ):
                        self.multi_views.add(step.target)
        except Exception:
            return False
        return True

    def shares_input(self, t: torch.Tensor) -> list[int]:
        key = _pointers(t)
        return [i for i, a in enumerate(self.inputs) if _pointers(a) & key]


def _pointers(t: torch.Tensor) -> set[int]:
    """The storages' data pointers under ``t`` (a TwoTensor's: its inner tensors')."""
    if fuzz_idioms.is_subclass(t):
        return set().union(*(_pointers(getattr(t, n)) for n in fuzz_idioms.inner_names(t)))
    return {t.untyped_storage().data_ptr()}


def _shape(draw, max_dims=3):
    return tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=max_dims)))


def _base(draw, two: bool = False, dtensor: bool = False) -> Base:
    shape = _shape(draw)
    rg = draw(st.booleans())
    layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed"]))
    placement = draw(st.sampled_from(["Replicate()", "Shard(0)"])) if dtensor else None
    return Base(shape, rg, layout == "transposed" and len(shape) >= 2, two, placement)


_ARG_VIEWS = ["{b}", "{b}", "{b}[1:]", "{b}.view(-1)", "{b}[0]", "{b}.t()", "{b}.unsqueeze(0)"]


@st.composite
def programs(draw, features: frozenset[str] | None = None, max_steps: int = 6) -> Program:
    features = enabled_features() if features is None else features
    n_bases = draw(st.integers(1, 2))
    # A tenth of the programs take TwoTensor arguments (one base or both).
    two = "subclass" in features and draw(st.integers(0, 9)) == 0
    # As many take DTensor arguments (not mixed with TwoTensors: DTensor refuses them).
    dtensor = (
        not two
        and "dtensor" in features
        and _dtensor_available()
        and draw(st.integers(0, DTENSOR_ONE_IN - 1)) == 0
    )
    bases = tuple(
        _base(draw, two and (i == 0 or draw(st.booleans())), dtensor) for i in range(n_bases)
    )
    n_args = draw(st.integers(1, 3))
    args: list[str] = []
    used: set[str] = set()
    prog_features: set[str] = set()
    for _ in range(n_args):
        b = f"b{draw(st.integers(0, n_bases - 1))}"
        view = draw(st.sampled_from(_ARG_VIEWS)).format(b=b)
        if b in used or view in args:
            equal_views = view in args and view != b
            if "alias_inputs" not in features or (
                equal_views and "equal_view_inputs" not in features
            ):
                continue
            prog_features.add("alias_inputs")
            if equal_views:
                prog_features.add("equal_view_inputs")
        used.add(b)
        args.append(view)
    if not args:
        args = ["b0"]
    state = () if two or dtensor else _draw_state(draw, features, n_bases)
    if two:
        prog_features.add("subclass")
    if dtensor:
        prog_features.add("dtensor")
        two = True  # the same idioms as TwoTensor arguments (no state, no verify)
    probe = Program(bases, tuple(args), (), ("a0",), ())
    try:
        program_args = probe.make_args()
    except Exception:
        from hypothesis import reject

        reject()
    env = _Env(program_args)
    # Arguments that are a parameter itself in the module/global idioms (``a0 = self.p0``).
    env.params = {
        f"a{i}"
        for i, a in enumerate(args)
        if a in {f"b{j}" for j in state if bases[j].requires_grad}
    }
    if any(_size1_strided(t) for t in env.inputs):
        if "size1_strided_input" not in features:
            from hypothesis import reject

            reject()
        prog_features.add("size1_strided_input")
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, max_steps))):
        step = _draw_step(draw, env, features)
        if step is None or not step.features <= features:
            continue
        if env.try_step(step):
            steps.append(step)
            prog_features |= step.features
    returns = _draw_returns(draw, env, features, prog_features)
    touch = "touch_outputs" in features and draw(st.integers(0, 3)) == 0
    if touch and env.multi_views & set(returns):
        touch = "multi_view_touched" in features
        prog_features.add("multi_view_touched")
    if touch:
        prog_features.add("touch_outputs")
    modes = tuple(
        m
        for m in ("dynamic", "twice", "compile")
        if m in features
        and not two
        and draw(st.integers(0, 3)) == 0
        and _mode_features(m, steps) <= features
    )
    if two or touch:
        modes += ("function",)
    for m in modes:
        prog_features |= _mode_features(m, steps)
    holder = draw(st.sampled_from(fuzz_idioms.HOLDERS))
    other = draw(st.sampled_from(["shape", "dtype"]))
    idioms = ["module", holder, "trace_module"] if state else []
    idioms += ["trace", "trace_other"]
    modes += tuple(m for m in idioms if _idiom_feature(m) in features)
    prog_features |= {
        _idiom_feature(m) for m in modes if m in fuzz_idioms.STATE_IDIOMS and m != "function"
    }
    create_graph = "create_graph" in features and draw(st.integers(0, 4)) == 0
    for feature, tag in (
        ("function_once", "once_differentiable_create_graph"),
        ("alias_inputs", "create_graph_aliased_inputs"),
        ("subclass", "subclass_create_graph"),
        ("dtensor", "dtensor_create_graph"),
    ):
        if create_graph and feature in prog_features:
            create_graph = tag in features
            prog_features.add(tag)
    if create_graph:
        prog_features.add("create_graph")
    under_no_grad = "call_under_no_grad" in features and draw(st.integers(0, 5)) == 0
    if under_no_grad and "requires_grad_" in prog_features:
        under_no_grad = "requires_grad_under_no_grad" in features
        prog_features.add("requires_grad_under_no_grad")
    regions = {step.region for step in steps}
    if under_no_grad and "enable_grad" in regions and any("view" in st_.features for st_ in steps):
        under_no_grad = "enable_grad_view_under_no_grad" in features
        prog_features.add("enable_grad_view_under_no_grad")
    if under_no_grad:
        prog_features.add("call_under_no_grad")
        traced = {"trace", "trace_other", "trace_module"} & set(modes)
        if traced and "trace_under_no_grad" not in features:
            modes = tuple(m for m in modes if m not in traced)
        elif traced:
            prog_features.add("trace_under_no_grad")
    return Program(
        bases,
        tuple(args),
        tuple(steps),
        returns,
        modes,
        under_no_grad,
        frozenset(prog_features),
        state,
        holder,
        other,
        create_graph,
        touch,
    )


def _draw_state(draw, features: frozenset[str], n_bases: int) -> tuple[int, ...]:
    """Which bases the module/global idioms hold as state: at least one, maybe all."""
    if not features & {"module", "global"}:
        return ()
    chosen = draw(st.lists(st.integers(0, n_bases - 1), min_size=1, max_size=n_bases, unique=True))
    return tuple(sorted(chosen))


def _idiom_feature(idiom: str) -> str:
    """The feature switching an idiom on (the holders share one)."""
    if idiom in fuzz_idioms.HOLDERS:
        return "global"
    return {"trace_other": "trace_other_spec"}.get(idiom, idiom)


def _size1_strided(t: torch.Tensor) -> bool:
    """Has a size-1 dimension, and other strides than ``contiguous()``'s."""
    return 1 in t.shape and t.stride() != t.contiguous().stride()


def _mode_features(mode: str, steps: list[Step]) -> set[str]:
    """The features a check mode adds to a program (known-bad combinations)."""
    if mode == "twice":
        return set()
    tags = {mode}
    exprs = " ".join(step.expr for step in steps)
    if mode == "dynamic" and re.search(r"clamp_|relu_", exprs):
        tags.add("dynamic_inplace_clamp")
    if mode == "dynamic" and "resize_" in exprs:
        tags.add("dynamic_resize")
    if mode == "compile" and any(step.region for step in steps):
        tags.add("compile_grad_mode")
    if mode == "compile" and "requires_grad_(" in exprs:
        tags.add("compile_requires_grad_")
    if mode == "compile" and re.search(r"set_\(|\.data =", exprs):
        tags.add("compile_set_")
    return tags


def _draw_returns(draw, env: _Env, features, prog_features: set[str]) -> tuple[str, ...]:
    names = list(env.values)
    produced = [n for n in names if n.startswith("v")]
    pool = produced or names
    chosen = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
    if "return_alias" in features and draw(st.integers(0, 3)) == 0:
        chosen.append(draw(st.sampled_from(names)))
    if len(set(chosen)) != len(chosen) or any(env.shares_input(env.values[n]) for n in chosen):
        if "return_alias" not in features:
            chosen = list(dict.fromkeys(n for n in chosen if not env.shares_input(env.values[n])))
            if not chosen:
                chosen = [f"{pool[0]}.sum()"] if pool else ["a0.sum()"]
                return tuple(chosen)
        else:
            prog_features.add("return_alias")
    subclass_inputs = {i for i, a in enumerate(env.inputs) if fuzz_idioms.is_subclass(a)}
    twice = [n for n in set(chosen) if chosen.count(n) > 1]
    if subclass_inputs and any(fuzz_idioms.is_subclass(env.values[n]) for n in twice):
        if "subclass_returned_twice" not in features:
            chosen = list(dict.fromkeys(chosen))
        else:
            prog_features.add("subclass_returned_twice")
    if any(set(env.shares_input(env.values[n])) & subclass_inputs for n in chosen):
        if "subclass_view_returned" not in features:
            chosen = [
                n for n in chosen if not set(env.shares_input(env.values[n])) & subclass_inputs
            ]
            if not chosen:
                return ("a0.sum()",)
        else:
            prog_features.add("subclass_view_returned")
    if _nograd_alias(env, chosen):
        if "return_nograd_alias" not in features:
            return tuple(n for n in dict.fromkeys(chosen) if n not in env.nograd) or ("a0.sum()",)
        prog_features.add("return_nograd_alias")
    return tuple(chosen)


def _nograd_alias(env: _Env, chosen: list[str]) -> bool:
    """Whether a returned value made without grad shares memory with another returned value."""
    storages = {}
    for n in chosen:
        for key in _pointers(env.values[n]):
            storages.setdefault(key, set()).add(n in env.nograd)
    return any(len(kinds) > 1 for kinds in storages.values())


def _dim(draw, t: torch.Tensor) -> int:
    return draw(st.integers(0, max(t.dim() - 1, 0)))


def _draw_step(draw, env: _Env, features) -> Step | None:
    name = draw(st.sampled_from(sorted(env.values)))
    x = env.values[name]
    other = draw(st.sampled_from(sorted(env.values)))
    kind = draw(
        st.sampled_from(
            ["view"] * 4
            + ["compute"] * 2
            + ["inplace"] * 4
            + ["metadata"] * 2
            + ["function"] * 4
            + ["random", "requires_grad_", "storage"]
        )
    )
    target = f"v{env.count}"
    tags: set[str] = set()
    shares = env.shares_input(x)
    if kind == "view":
        expr, tag = _view_expr(draw, name, x)
        tags.add(tag)
        if ".reshape(" in expr and not x.is_contiguous():
            tags.add("reshape_size1_strides")
    elif kind == "compute":
        expr = draw(
            st.sampled_from(
                [
                    "{x} * 2",
                    "{x}.sin()",
                    "{x} + {o}.sum()",
                    "{x}.clone()",
                    "{x}.exp()",
                    "{x} * {o}.mean()",
                    "torch.where({x} > 0, {x}, {o}.sum())",
                ]
            )
        ).format(x=name, o=other)
        tags.add("compute")
    elif kind == "inplace":
        expr = draw(
            st.sampled_from(
                [
                    "{x}.add_(1.5)",
                    "{x}.mul_({o}.sum())",
                    "{x}.add_({o}.mean())",
                    "{x}.copy_({x} * 2 + {o}.sum())",
                    "{x}.zero_()",
                    "{x}.clamp_(-0.5, 0.5)",
                    "{x}.relu_()",
                    "{x}.index_put_((torch.tensor([0]),), torch.tensor(2.5))",
                    "{x}.masked_fill_({x} > 0, 0.25)",
                ]
            )
        ).format(x=name, o=other)
        tags.add("inplace")
        if shares:
            tags.add("inplace_input")
        if "masked_fill_" in expr and not x.is_contiguous():
            tags.add("masked_fill_strided")
        if not fuzz_idioms.is_subclass(x) and torch._debug_has_internal_overlap(x) != 0:
            tags.add("inplace_overlapping")
        target = None  # a statement
    elif kind == "metadata":
        expr = _metadata_expr(draw, name, x)
        tags.add("metadata")
        if shares:
            tags.add("metadata_input")
            if _aliased_input(env, shares):
                tags.add("metadata_aliased_input")
                if "resize_" in expr and not x.is_contiguous():
                    tags.add("resize_strided_aliased_input")
            if any(fuzz_idioms.is_subclass(env.inputs[i]) for i in shares):
                tags.add("subclass_metadata_input")
        target = None
    elif kind == "storage":
        # set_() or a .data assignment: x takes other's storage, shape and strides.
        form = draw(
            st.sampled_from(["{x}.set_({o})", "{x}.set_({o}.detach() * 2)", "{x}.data = {o}"])
        )
        expr = form.format(x=name, o=other)
        tags.add("data_assign" if ".data =" in expr else "set_")
        if shares and "set_" in tags:
            tags.add("set_input")
        target = None
    elif kind == "function":
        fn_name = draw(st.sampled_from([*BINARY_FUNCTIONS, *sorted(FUNCTIONS)]))
        tags.add(FUNCTION_FEATURES[fn_name])
        two_outputs = fn_name in ("NonDifferentiable", "AddMeanMask", "NoMaterialize")
        index = f"[{draw(st.integers(0, 1))}]" if two_outputs else ""
        operands = [name]
        if fn_name in BINARY_FUNCTIONS:
            # Often a parameter (or buffer, or global tensor) itself: MulSum.apply(v0, self.p0).
            params = sorted(env.params)
            pool = params if params and draw(st.booleans()) else sorted(env.values)
            operands.append(draw(st.sampled_from(pool)))
        if set(operands) & env.params:
            tags.add("function_param")
        expr = f"{fn_name}.apply({', '.join(operands)}){index}"
        if fn_name == "MarksDirty" and shares:
            tags.add("inplace_input")
    elif kind == "random":
        expr = draw(
            st.sampled_from(
                [
                    "F.dropout({x}, 0.5)",
                    "{x} * torch.rand_like({x})",
                    "{x} + torch.randn_like({x})",
                    "torch.bernoulli(torch.full_like({x}, 0.5))",
                    "{x} * torch.bernoulli(torch.full_like({x}, 0.5))",
                    "F.dropout({x}, 0.3, inplace=True)",
                ]
            )
        ).format(x=name)
        tags.add("random" if x.is_contiguous() else "random_strided")
        if "inplace=True" in expr:
            tags.add("inplace")
            if shares:
                tags.add("inplace_input")
    else:
        expr = f"{name}.requires_grad_(True)"
        tags.add("requires_grad_")
        if name.startswith("v"):
            tags.add("requires_grad_intermediate")
        target = None
    region = None
    if "grad_mode" in features and draw(st.integers(0, 4)) == 0:
        region = draw(st.sampled_from(["no_grad", "enable_grad"]))
        tags.add("grad_mode")
        if region == "no_grad" and tags & {"view", "multi_view", "as_strided"}:
            tags.add("nograd_view")
    if target is not None:
        env.count += 1
    return Step(expr=expr, target=target, region=region, features=frozenset(tags))


def _aliased_input(env: _Env, shares: list[int]) -> bool:
    """Whether an input this value shares memory with also shares it with another input."""
    for i in shares:
        key = _pointers(env.inputs[i])
        if any(a is not env.inputs[i] and _pointers(a) & key for a in env.inputs):
            return True
    return False


def _view_expr(draw, name: str, x: torch.Tensor) -> tuple[str, str]:
    d = _dim(draw, x)
    size = x.shape[d] if x.dim() else 1
    choices = [
        (f"{name}.view(-1)", "view"),
        (f"{name}.reshape({', '.join(map(str, reversed(x.shape))) or '-1'})", "view"),
        (f"{name}.t()", "view"),
        (f"{name}.transpose(0, {d})", "view"),
        (f"{name}.permute{tuple(reversed(range(x.dim())))}", "view"),
        (f"{name}.expand(2, *{name}.shape)", "view"),
        (f"{name}.narrow({d}, {min(1, size - 1)}, 1)", "view"),
        (f"{name}[1:]", "view"),
        (f"{name}[..., ::2]", "view"),
        (f"{name}[0]", "view"),
        (f"{name}.unsqueeze({d})", "view"),
        (f"{name}.squeeze()", "view"),
        (f"{name}.diagonal()", "view"),
        (f"{name}.detach()", "view"),
        (f"{name}.unbind({d})[{draw(st.integers(0, max(size - 1, 0)))}]", "multi_view"),
        (f"{name}.split(1, {d})[{draw(st.integers(0, max(size - 1, 0)))}]", "multi_view"),
        (_as_strided(draw, name, x, "as_strided"), "as_strided"),
    ]
    return draw(st.sampled_from(choices))


def _as_strided(draw, name: str, x: torch.Tensor, method: str) -> str:
    """An ``as_strided`` over elements ``x`` itself covers.

    Eager's gradient of an ``as_strided`` reaching storage outside its input is not the
    derivative (``p[0].as_strided((1, 3), (2, 1), 6)`` gets zeros), so such programs have no
    reference: they stay within ``x``, and only where ``x`` covers every element of its span.
    """
    lo = x.storage_offset()
    span = sum((n - 1) * st_ for n, st_ in zip(x.shape, x.stride(), strict=True))
    dense = (
        not fuzz_idioms.is_subclass(x)
        and x.numel() > 0
        and x.numel() == span + 1
        and torch._debug_has_internal_overlap(x) == 0
    )
    rows = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 3))
    stride = (draw(st.integers(0, 3)), draw(st.integers(0, 2)))
    reach = (rows - 1) * stride[0] + (cols - 1) * stride[1]
    if not dense or reach > span:
        rows, cols, stride, reach = 1, 1, (0, 0), 0
    offset = draw(st.integers(lo, lo + (span - reach if dense else 0)))
    return f"{name}.{method}(({rows}, {cols}), {stride}, {offset})"


def _metadata_expr(draw, name: str, x: torch.Tensor) -> str:
    d = _dim(draw, x)
    choices = [
        f"{name}.t_()",
        f"{name}.transpose_(0, {d})",
        f"{name}.unsqueeze_({d})",
        f"{name}.squeeze_()",
        _as_strided(draw, name, x, "as_strided_"),
    ]
    # resize_ only within the storage: growing it exposes uninitialized memory (eager differs
    # from itself).
    if fuzz_idioms.is_subclass(x):
        return draw(st.sampled_from(choices))
    room = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    choices += [f"{name}.resize_({n})" for n in {max(x.numel() // 2, 1), x.numel()} if n <= room]
    return draw(st.sampled_from(choices))


# --- checking ---------------------------------------------------------------------------------
# "aot", "dynamic" and "twice" run ``aotgrad.testing.verify`` on ``fn`` over arguments; the
# idioms over state, trace-then-call and torch.compile run ``fuzz_idioms.run_idiom``, which
# compares every gradient itself (parameters' and global tensors' included).

VERIFY_MODES = ("aot", "dynamic", "twice")


class EagerRejected(Exception):
    """Eager itself fails on the program: it is not a test case."""


@dataclass
class Outcome:
    refusals: list[str] = field(default_factory=list)
    compiled: int = 0
    # Idioms eager itself could not run (an in-place op on a parameter, say): not compared.
    skipped: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # CPU time per idiom


def _eager_reference(program: Program, fn: Callable[..., Any], create_graph: bool = False) -> None:
    """Run forward and backward eagerly, as verify will; raise EagerRejected if eager fails.

    With ``create_graph`` the gradients are differentiated once more, as
    ``verify(..., create_graph=True)`` does.
    """
    call_args = program.make_args()  # fresh tensors (a TwoTensor cannot be copied by verify)
    try:
        with _fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _called(fn, program.under_no_grad)(*call_args)
            leaves = [
                t
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
            ]
            if not leaves:
                return
            cotangents = [torch.randn_like(t) for t in leaves]
            if not create_graph:
                torch.autograd.backward(leaves, cotangents)
                return
            inputs = [t for t in call_args if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = torch.autograd.grad(
                leaves, inputs, cotangents, create_graph=True, allow_unused=True
            )
            again = [
                (g * torch.randn_like(g)).sum() for g in grads if g is not None and g.requires_grad
            ]
            if again:
                torch.autograd.grad(sum(again), inputs, allow_unused=True)
    except Exception as err:
        raise EagerRejected(repr(err)) from err


def _called(fn: Callable[..., Any], under_no_grad: bool) -> Callable[..., Any]:
    if not under_no_grad:
        return fn

    def run_under_no_grad(*args):
        with torch.no_grad():
            return fn(*args)

    return run_under_no_grad


def check(program: Program, create_graph: bool | None = None) -> Outcome:
    """Check ``program`` in every idiom; raise FuzzFailure, or EagerRejected when eager fails.

    ``create_graph`` (default: the program's): second-order gradients too.
    """
    create_graph = program.create_graph if create_graph is None else create_graph
    namespace = program.make_namespace()
    fn = namespace["fn"]
    _eager_reference(program, fn, create_graph)
    outcome = Outcome()
    options = dict(create_graph=create_graph, under_no_grad=program.under_no_grad)
    subclass = any(b.subclass for b in program.bases)  # verify cannot copy subclass arguments
    for mode in ("aot", *program.modes)[subclass:]:
        start = time.process_time()
        try:
            if mode in VERIFY_MODES:
                _verify_mode(fn, program.make_args, mode, **options)
            else:
                fuzz_idioms.run_idiom(
                    program.make_namespace,
                    mode,
                    holder=program.holder,
                    other=program.other,
                    touch_outputs=program.touch_outputs,
                    **options,
                )
        except AotgradError as err:
            outcome.refusals.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        except fuzz_idioms.EagerFails as err:
            outcome.skipped.append(f"{mode}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        except FuzzFailure as failure:
            if failure.signature in tolerated_signatures():
                continue
            mode_name = f"{mode}+create_graph" if create_graph else mode
            raise FuzzFailure(mode_name, failure.signature, failure.detail) from None
        finally:
            outcome.seconds[mode] = time.process_time() - start
        outcome.compiled += 1
    return outcome


def _verify_mode(
    fn: Callable[..., Any],
    make_args: Callable[[], tuple[Any, ...]],
    mode: str,
    create_graph: bool,
    under_no_grad: bool,
) -> None:
    """``verify`` over arguments: once ("aot"), ``dynamic=True``, or one compiled fn twice."""
    if mode == "twice":
        compiled = aotgrad.aot_function(fn)
        compile_fns = [lambda f: compiled] * 2
    elif mode == "dynamic":
        compile_fns = [lambda f: aotgrad.aot_function(f, dynamic=True)]
    else:
        compile_fns = [aotgrad.aot_function]
    for compile_fn in compile_fns:
        _verify_once(fn, make_args(), compile_fn, create_graph, under_no_grad)


def _verify_once(fn, args, compile_fn, create_graph: bool, under_no_grad: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", DirectTracerBugWarning)  # Note [Choosing a tracer]
            testing.verify(
                _called(fn, under_no_grad),
                *args,
                compile_fn=lambda called: _called(compile_fn(fn), under_no_grad),
                create_graph=create_graph,
            )
    except testing.VerificationError as err:
        raise FuzzFailure("", mismatch_signature(str(err)), str(err)) from None
    except AotgradError:
        raise
    except Exception as err:
        raise FuzzFailure("", error_signature(err), short_traceback(err)) from None


# --- command line: a long triage run that collects distinct failures, then shrinks each ----------


def _main() -> None:  # pragma: no cover - run by `make fuzz`
    import argparse

    from hypothesis import given, seed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--features", default=os.environ.get("AOTGRAD_FUZZ_FEATURES", "all"))
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument(
        "--create-graph",
        action="store_const",
        const=True,
        help="check second-order gradients on every program (by default: on a fifth of them)",
    )
    parser.add_argument(
        "--dtensor-one-in", type=int, help="one program in so many takes DTensors (default 10)"
    )
    parser.add_argument("--shrink-key", help="skip exploring: replay the seed and shrink this key")
    opts = parser.parse_args()
    os.environ["AOTGRAD_FUZZ_FEATURES"] = opts.features
    if opts.dtensor_one_in:
        global DTENSOR_ONE_IN
        DTENSOR_ONE_IN = opts.dtensor_one_in
    features = enabled_features()
    if opts.shrink_key:
        program = _shrink(opts, features, opts.shrink_key, None)
        print(f"{opts.shrink_key}\n{program!r}")
        return
    found: dict[str, Program] = {}
    counts: dict[str, int] = {}
    refusals: dict[str, int] = {}
    times: dict[str, float] = {}  # CPU seconds per idiom
    stats = {"checked": 0, "rejected": 0, "idiom runs": 0, "refused": 0, "skipped": 0}

    @seed(opts.seed)
    @settings(
        max_examples=opts.examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(programs(features))
    def explore(program: Program) -> None:
        try:
            outcome = check(program, opts.create_graph)
        except EagerRejected:
            stats["rejected"] += 1
            return
        except FuzzFailure as failure:
            key = f"[{failure.mode}] {failure.signature}"
            counts[key] = counts.get(key, 0) + 1
            if key not in found or len(repr(program)) < len(repr(found[key])):
                found[key] = program
                print(f"\n=== new failure: {key}", flush=True)
            return
        stats["checked"] += 1
        stats["idiom runs"] += outcome.compiled
        stats["refused"] += len(outcome.refusals)
        stats["skipped"] += len(outcome.skipped)
        for mode, seconds in outcome.seconds.items():
            times[mode] = times.get(mode, 0.0) + seconds
        for r in outcome.refusals:
            r = fuzz_idioms._NUMBERS.sub("N", r)[:120]
            refusals[r] = refusals.get(r, 0) + 1
        if stats["checked"] % 100 == 0:
            print(f"... {stats} failures={len(found)}", flush=True)
            torch._dynamo.reset()

    explore()
    print(f"\n{stats}; {len(found)} distinct failures")
    print("CPU seconds per idiom:", {m: round(t, 1) for m, t in sorted(times.items())})
    print("\nRefusals seen (documented errors, acceptable):")
    for r, n in sorted(refusals.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {r}")
    for key, program in sorted(found.items()):
        if not opts.no_shrink:
            program = _shrink(opts, features, key, program)
        print(f"\n{'=' * 100}\n{key}  (seen {counts[key]} times)\n{program!r}")
        try:
            check(program, opts.create_graph)
        except FuzzFailure as failure:
            print("# " + "\n# ".join(failure.detail.splitlines()[:14]))
        except Exception as err:
            print(f"# (no longer fails the same way: {err!r})")


def _shrink(opts, features, key: str, program: Program | None) -> Program | None:
    """Replay the exploration (same seed) until ``key`` fails, and let Hypothesis shrink it."""
    from hypothesis import Phase, given, seed

    last: list[Program | None] = [program]

    @seed(opts.seed)
    @settings(
        max_examples=opts.examples,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(programs(features))
    def reproduce(p: Program) -> None:
        try:
            check(p, opts.create_graph)
        except FuzzFailure as failure:
            if f"[{failure.mode}] {failure.signature}" == key:
                last.append(p)
                raise
        except Exception:
            return

    with contextlib.suppress(FuzzFailure):
        reproduce()
    return last[-1]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.modules["fuzz_programs"] = sys.modules["__main__"]  # program files import from it
    _main()
