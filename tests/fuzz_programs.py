"""Random small programs checked against eager: the differential fuzzer's generator and checker.

A :class:`Program` is a few input tensors (fresh, passed twice, or views of one base passed
together) and a list of steps over them (views, in-place ops, metadata mutation, custom
``autograd.Function``s, ``no_grad``/``enable_grad`` regions, random ops), returning some of
its values. ``repr(program)`` is a runnable Python script, so a shrunk failure prints as its
own repro. :func:`check` runs a program eagerly (a program eager rejects is discarded) and
through ``aot_function``, ``aot_function(dynamic=True)``, a second call of the same compiled
function, and ``torch.compile(backend="aotgrad")``, each with ``aotgrad.testing.verify``.
A documented refusal (an ``aotgrad.errors.AotgradError``) is acceptable; a mismatch or any
other exception is a :class:`FuzzFailure`.

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
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import aotgrad
from aotgrad import testing
from aotgrad.capture import DirectTracerBugWarning
from aotgrad.errors import AotgradError

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
    }
)

# Features that trigger known defects: not generated unless enabled (see the module docstring).
KNOWN_BAD: dict[str, str] = {
    "compile_requires_grad_": "NEW F13: torch.compile, requires_grad_() on a mutated input viewed",
    "requires_grad_under_no_grad": "NEW F15: requires_grad_() on a no_grad view of an input",
}

# Known-bad *differences* no feature isolates: a failure whose signature is listed is tolerated
# unless its name is enabled like a feature (AOTGRAD_FUZZ_FEATURES=<name>). None at present.
KNOWN_BAD_SIGNATURES: dict[str, tuple[str, str]] = {
    "F16": (
        "mismatch: output: requires_grad True != eager False",
        "NEW F16: under no_grad, a custom Function's output of an aliased input that the function"
        " then makes require grad requires grad",
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


FUNCTIONS = {
    "NewTensor": NewTensor,
    "ReturnsInput": ReturnsInput,
    "ReturnsView": ReturnsView,
    "MarksDirty": MarksDirty,
    "NonDifferentiable": NonDifferentiable,
}

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
class Program:
    bases: tuple[str, ...]  # source of each base tensor b0, b1, ...
    args: tuple[str, ...]  # source of each argument, over the bases
    steps: tuple[Step, ...]
    returns: tuple[str, ...]
    modes: tuple[str, ...]  # besides "aot": "dynamic", "twice", "compile"
    under_no_grad: bool = False
    features: frozenset[str] = field(default=frozenset(), compare=False)

    def function_source(self) -> str:
        params = ", ".join(f"a{i}" for i in range(len(self.args)))
        body = [line for step in self.steps for line in step.lines()]
        body.append(f"return {', '.join(self.returns)}" + ("," if len(self.returns) == 1 else ""))
        return "\n".join([f"def fn({params}):", *("    " + line for line in body)])

    def inputs_source(self) -> str:
        lines = ["torch.manual_seed(0)"]
        lines += [f"b{i} = {src}" for i, src in enumerate(self.bases)]
        lines.append(f"args = ({', '.join(self.args)}{',' if len(self.args) == 1 else ''})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        calls = {
            "aot": "verify(fn, *args)",
            "dynamic": "verify(fn, *args, compile_fn=lambda f: aotgrad.aot_function(f, dynamic=True))",
            "twice": "compiled = aotgrad.aot_function(fn)\nverify(fn, *args, compile_fn=lambda f: compiled)\nverify(fn, *args, compile_fn=lambda f: compiled)",
            "compile": 'verify(fn, *args, compile_fn=lambda f: torch.compile(f, backend="aotgrad"))',
        }
        run = [calls["aot"], *(calls[m] for m in self.modes)]
        if self.under_no_grad:
            run = ["# the compiled function is called under no_grad (see run_under_no_grad)", *run]
        imports = (
            "import torch\nimport torch.nn.functional as F\nimport aotgrad\n"
            "from aotgrad.testing import verify\n"
            f"from fuzz_programs import {', '.join(sorted(FUNCTIONS))}\n"
        )
        return "\n".join(["", imports, self.function_source(), "", self.inputs_source(), *run, ""])

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # Hypothesis prints the runnable script, not the fields

    def make_function(self) -> Callable[..., Any]:
        """``fn`` compiled from a real file, so tracebacks and source lines work."""
        src = "import torch\nimport torch.nn.functional as F\n\n" + self.function_source() + "\n"
        digest = hashlib.sha1(src.encode()).hexdigest()[:16]
        path = os.path.join(_program_dir(), f"prog_{digest}.py")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(src)
        namespace: dict[str, Any] = {"__name__": f"fuzz_prog_{digest}", **FUNCTIONS}
        exec(compile(src, path, "exec"), namespace)
        return namespace["fn"]

    def make_args(self) -> tuple[Any, ...]:
        namespace: dict[str, Any] = {"torch": torch}
        with _fork_rng():
            exec(self.inputs_source(), namespace)
        return namespace["args"]


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
        copies = testing._copy_call(program_args, {}).args
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

    def try_step(self, step: Step) -> bool:
        namespace = {"torch": torch, "F": F, **FUNCTIONS, **self.values}
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
        except Exception:
            return False
        return True

    def shares_input(self, t: torch.Tensor) -> list[int]:
        key = t.untyped_storage().data_ptr()
        return [i for i, a in enumerate(self.inputs) if a.untyped_storage().data_ptr() == key]


def _shape(draw, max_dims=3):
    return tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=max_dims)))


def _base(draw) -> str:
    shape = _shape(draw)
    rg = draw(st.booleans())
    layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed"]))
    if layout == "transposed" and len(shape) >= 2:
        rev = tuple(reversed(shape))
        src = f"torch.randn{rev}.permute{tuple(reversed(range(len(shape))))}"
        return src + (".requires_grad_()" if rg else "")
    return f"torch.randn({', '.join(map(str, shape))}{', requires_grad=True' if rg else ''})"


_ARG_VIEWS = ["{b}", "{b}", "{b}[1:]", "{b}.view(-1)", "{b}[0]", "{b}.t()", "{b}.unsqueeze(0)"]


@st.composite
def programs(draw, features: frozenset[str] | None = None, max_steps: int = 6) -> Program:
    features = enabled_features() if features is None else features
    n_bases = draw(st.integers(1, 2))
    bases = tuple(_base(draw) for _ in range(n_bases))
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
    bases_src = bases
    probe = Program(bases_src, tuple(args), (), ("a0",), ())
    try:
        program_args = probe.make_args()
    except Exception:
        from hypothesis import reject

        reject()
    env = _Env(program_args)
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
    modes = tuple(
        m
        for m in ("dynamic", "twice", "compile")
        if m in features and draw(st.integers(0, 3)) == 0 and _mode_features(m, steps) <= features
    )
    for m in modes:
        prog_features |= _mode_features(m, steps)
    under_no_grad = "call_under_no_grad" in features and draw(st.integers(0, 5)) == 0
    if under_no_grad and "requires_grad_" in prog_features:
        under_no_grad = "requires_grad_under_no_grad" in features
        prog_features.add("requires_grad_under_no_grad")
    if under_no_grad:
        prog_features.add("call_under_no_grad")
    return Program(
        bases_src,
        tuple(args),
        tuple(steps),
        returns,
        modes,
        under_no_grad,
        frozenset(prog_features),
    )


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
    if _nograd_alias(env, chosen):
        if "return_nograd_alias" not in features:
            return tuple(n for n in dict.fromkeys(chosen) if n not in env.nograd) or ("a0.sum()",)
        prog_features.add("return_nograd_alias")
    return tuple(chosen)


def _nograd_alias(env: _Env, chosen: list[str]) -> bool:
    """Whether a returned value made without grad shares memory with another returned value."""
    storages = {}
    for n in chosen:
        storages.setdefault(env.values[n].untyped_storage().data_ptr(), set()).add(n in env.nograd)
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
            + ["function"] * 2
            + ["random", "requires_grad_"]
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
        if torch._debug_has_internal_overlap(x) != 0:
            tags.add("inplace_overlapping")
        target = None  # a statement
    elif kind == "metadata":
        expr = _metadata_expr(draw, name, x)
        tags.add("metadata")
        if shares:
            tags.add("metadata_input")
            if _aliased_input(env, shares):
                tags.add("metadata_aliased_input")
        target = None
    elif kind == "function":
        fn_name = draw(st.sampled_from(sorted(FUNCTIONS)))
        tags.add(
            {
                "NewTensor": "function",
                "ReturnsInput": "function_returns_input",
                "ReturnsView": "function_view",
                "MarksDirty": "function_dirty",
                "NonDifferentiable": "function_nondiff",
            }[fn_name]
        )
        index = f"[{draw(st.integers(0, 1))}]" if fn_name == "NonDifferentiable" else ""
        expr = f"{fn_name}.apply({name}){index}"
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
        key = env.inputs[i].untyped_storage().data_ptr()
        if any(
            a is not env.inputs[i] and a.untyped_storage().data_ptr() == key for a in env.inputs
        ):
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
    n = x.untyped_storage().nbytes() // max(x.element_size(), 1)
    rows = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 3))
    stride = (draw(st.integers(0, 3)), draw(st.integers(0, 2)))
    offset = draw(st.integers(0, max(n - 1, 0)))
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
    room = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    choices += [f"{name}.resize_({n})" for n in {max(x.numel() // 2, 1), x.numel()} if n <= room]
    return draw(st.sampled_from(choices))


# --- checking ---------------------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """aotgrad differed from eager, or failed with an error that is not a documented refusal."""

    def __init__(self, mode: str, signature: str, detail: str):
        super().__init__(f"[{mode}] {signature}\n{detail}")
        self.mode = mode
        self.signature = signature
        self.detail = detail


class EagerRejected(Exception):
    """Eager itself fails on the program: it is not a test case."""


@dataclass
class Outcome:
    refusals: list[str] = field(default_factory=list)
    compiled: int = 0


def _eager_reference(program: Program, fn: Callable[..., Any], create_graph: bool = False) -> None:
    """Run forward and backward eagerly, as verify will; raise EagerRejected if eager fails.

    With ``create_graph`` the gradients are differentiated once more, as
    ``verify(..., create_graph=True)`` does.
    """
    call = testing._copy_call(program.make_args(), {})
    try:
        with _fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _called(fn, program)(*call.args)
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
            inputs = [t for t in call.args if isinstance(t, torch.Tensor) and t.requires_grad]
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


def _called(fn: Callable[..., Any], program: Program) -> Callable[..., Any]:
    if not program.under_no_grad:
        return fn

    def run_under_no_grad(*args):
        with torch.no_grad():
            return fn(*args)

    return run_under_no_grad


def _compilers(program: Program, fn: Callable[..., Any]):
    yield "aot", [lambda f: aotgrad.aot_function(f)]
    for mode in program.modes:
        if mode == "dynamic":
            yield mode, [lambda f: aotgrad.aot_function(f, dynamic=True)]
        elif mode == "twice":
            compiled = aotgrad.aot_function(fn)
            yield mode, [lambda f, c=compiled: c, lambda f, c=compiled: c]
        elif mode == "compile":
            yield mode, [_fresh_compile]


def _fresh_compile(f):
    # Dynamo keeps state across programs (automatic dynamic shapes when one source recurs).
    torch._dynamo.reset()
    return torch.compile(f, backend="aotgrad")


def check(program: Program, create_graph: bool = False) -> Outcome:
    """Verify ``program`` in every mode; raise FuzzFailure, or EagerRejected when eager fails.

    ``create_graph``: second-order gradients too (``verify(..., create_graph=True)``).
    """
    fn = program.make_function()
    _eager_reference(program, fn, create_graph)
    outcome = Outcome()
    for mode, compile_fns in _compilers(program, fn):
        for compile_fn in compile_fns:
            try:
                _verify_once(program, fn, compile_fn, create_graph)
            except AotgradError as err:
                outcome.refusals.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
                break
            except FuzzFailure as failure:
                if failure.signature in tolerated_signatures():
                    break
                if mode == "compile" and _dynamo_alone_fails(program, fn):
                    break
                raise FuzzFailure(mode, failure.signature, failure.detail) from None
            outcome.compiled += 1
    return outcome


def _verify_once(program: Program, fn, compile_fn, create_graph: bool = False) -> None:
    called = _called(fn, program)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", DirectTracerBugWarning)  # Note [Choosing a tracer]
            testing.verify(
                called,
                *program.make_args(),
                compile_fn=_wrapped(compile_fn, program),
                create_graph=create_graph,
            )
    except testing.VerificationError as err:
        raise FuzzFailure("", _mismatch_signature(str(err)), str(err)) from None
    except AotgradError:
        raise
    except Exception as err:
        raise FuzzFailure("", _error_signature(err), _short_traceback(err)) from None


def _wrapped(compile_fn, program: Program):
    def compile_program(called):
        return _called(compile_fn(program_fn_of(called)), program)

    return compile_program


def program_fn_of(called):
    return called.__closure__[0].cell_contents if called.__name__ == "run_under_no_grad" else called


def _dynamo_alone_fails(program: Program, fn) -> bool:
    """A torch.compile failure that Dynamo's own eager backend shares is not aotgrad's."""
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            testing.verify(
                _called(fn, program),
                *program.make_args(),
                compile_fn=_wrapped(lambda f: torch.compile(f, backend="eager"), program),
            )
    except Exception:
        return True
    return False


_NUMBERS = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")


def _mismatch_signature(text: str) -> str:
    kinds = set()
    for line in text.splitlines()[1:]:
        line = line.split(" (")[0]
        line = re.sub(r"^(output|input|grad of)[^:]*:", r"\1:", line)
        line = re.sub(r"torch\.\w+\[[^\]]*\] != eager torch\.\w+\[[^\]]*\]", "shape differs", line)
        kinds.add(_NUMBERS.sub("N", line)[:80])
    return "mismatch: " + "; ".join(sorted(kinds))


def _error_signature(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    where = "?"
    for frame in reversed(frames):
        if "aotgrad" in frame.filename or "torch" in frame.filename:
            where = f"{os.path.basename(frame.filename)}:{frame.name}"
            break
    message = str(err).splitlines()[0] if str(err) else ""
    message = _NUMBERS.sub("N", re.sub(r"<[^>]*>", "<...>", message))[:70]
    return f"{type(err).__name__} at {where}: {message}"


def _short_traceback(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)[-12:])


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
        "--create-graph", action="store_true", help="check second-order gradients too"
    )
    parser.add_argument("--shrink-key", help="skip exploring: replay the seed and shrink this key")
    opts = parser.parse_args()
    os.environ["AOTGRAD_FUZZ_FEATURES"] = opts.features
    features = enabled_features()
    if opts.shrink_key:
        program = _shrink(opts, features, opts.shrink_key, None)
        print(f"{opts.shrink_key}\n{program!r}")
        return
    found: dict[str, Program] = {}
    counts: dict[str, int] = {}
    refusals: dict[str, int] = {}
    stats = {"checked": 0, "rejected": 0}

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
        for r in outcome.refusals:
            r = _NUMBERS.sub("N", r)[:120]
            refusals[r] = refusals.get(r, 0) + 1
        if stats["checked"] % 100 == 0:
            print(f"... {stats} failures={len(found)}", flush=True)
            torch._dynamo.reset()

    explore()
    print(f"\n{stats}; {len(found)} distinct failures")
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
    _main()
