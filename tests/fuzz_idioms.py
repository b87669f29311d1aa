"""One fuzz program run the ways users call aotgrad, each compared with eager.

A program file (``fuzz_programs.Program.script()``) defines ``fn`` over arguments, ``Model``
(some of the program's base tensors as parameters, those requiring grad, and buffers, the
rest), a loss over a global module, a closed-over module or global tensors, and
``make_inputs(seed, other)``. Each idiom builds two independent *worlds* from fresh copies of
that file (eager's and aotgrad's), runs them on the same random-number state and compares
everything a caller can observe:

- every output: structure, values, shape, dtype, ``requires_grad``, leafness, which input,
  parameter, buffer or earlier output it aliases (and its strides then);
- every tensor after the call: arguments, their bases, parameters, buffers, global tensors
  (values, strides, offset, ``requires_grad``);
- every gradient: ``.grad`` of every leaf among them, parameters' and globals' included; with
  ``create_graph`` the first-order gradients taken with ``create_graph=True`` and the
  second-order gradients of a random weighted sum of them (cotangents included).

This comparison is the fuzzer's own: until ``aotgrad.testing.verify`` compares the gradients of
tensors a function reaches through modules and globals, it cannot be trusted for these idioms.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

import aotgrad
from aotgrad.capture.tracing.tracers import DirectTracerBugWarning
from aotgrad.errors import AotgradError
from aotgrad.signature import storage_key

# Idioms over the program's state (parameters, buffers, global tensors) and trace-then-call;
# "function": ``aot_function`` over the arguments, compared here rather than by ``verify`` (which
# cannot copy tensor-subclass arguments, and takes no action on the outputs after the call).
# ``holder``: the loss function reads a module held in a global ("global_module"), in a
# closure ("closure_module"), or reads global tensors without a module ("global_tensors").
HOLDERS = ("global_module", "closure_module", "global_tensors")
STATE_IDIOMS = ("module", *HOLDERS, "trace", "trace_other", "trace_module", "compile", "function")


class FuzzFailure(AssertionError):
    """aotgrad differed from eager, or failed with an error that is not a documented refusal."""

    def __init__(self, mode: str, signature: str, detail: str):
        super().__init__(f"[{mode}] {signature}\n{detail}")
        self.mode = mode
        self.signature = signature
        self.detail = detail


class EagerFails(Exception):
    """Eager itself fails in this idiom (or on these inputs): nothing to compare."""


@dataclass
class World:
    """One independent copy of what a call reads: the callee, its arguments, its state."""

    target: Any  # called: fn, a Model, or the loss over a global
    args: tuple[Any, ...]
    # Every tensor compared after the call, by name; the leaves' ``.grad`` is compared too.
    named: list[tuple[str, torch.Tensor]]


@contextlib.contextmanager
def fork_rng() -> Iterator[None]:
    state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def world(
    namespace: dict[str, Any],
    form: str,
    state_seed: int = 0,
    arg_seed: int = 0,
    other: str | None = None,
) -> World:
    """Build ``form`` ("function", "module" or a holder) in a fresh program namespace.

    The state (parameters, buffers, global tensors) comes from ``make_inputs(state_seed)``;
    the arguments from ``make_inputs(arg_seed, other)`` (``other``: another specialization).
    """
    with fork_rng():
        state_bases, _ = namespace["make_inputs"](state_seed)
        try:
            bases, args = namespace["make_inputs"](arg_seed, other)
        except Exception as err:  # another specialization the arguments' views cannot take
            raise EagerFails(f"make_inputs({arg_seed}, {other!r}): {err!r}") from err
    if form == "function":
        named = [*_names("b", bases, range(len(bases))), *_names("a", args, range(len(args)))]
        return World(namespace["fn"], tuple(args), named)
    state_ids, free_ids = namespace["STATE"], namespace["FREE"]
    free = tuple(args[i] for i in free_ids)
    free_bases = [j for j in range(len(bases)) if j not in state_ids]
    named = [*_names("a", args, free_ids), *_names("b", bases, free_bases)]
    state = [state_bases[j] for j in state_ids]
    if form == "global_tensors":
        for j, t in zip(state_ids, state, strict=True):
            namespace[f"P{j}"] = t
        return World(namespace["loss"], free, [*_names("P", state_bases, state_ids), *named])
    model = namespace["Model"](*state)
    named = [*model_tensors(model), *named]
    if form == "module":
        return World(model, free, named)
    if form == "global_module":
        namespace["model"] = model
        return World(namespace["loss"], free, named)
    assert form == "closure_module", f"expected a form, got {form!r}"
    return World(namespace["make_loss"](model), free, named)


def _names(prefix: str, tensors: Any, indices: Any) -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}{i}", tensors[i]) for i in indices]


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    state = [*model.named_parameters(), *model.named_buffers()]
    return [(f"model.{n}", t) for n, t in state]


# --- running one idiom ---------------------------------------------------------------------------


def run_idiom(
    make_namespace: Callable[[], dict[str, Any]],
    idiom: str,
    *,
    holder: str,
    other: str,
    create_graph: bool = False,
    under_no_grad: bool = False,
    touch_outputs: bool = False,
) -> None:
    """Run one idiom and compare with eager: FuzzFailure, AotgradError, or EagerFails.

    ``touch_outputs``: after the call, change every output in place (``mul_(1)``), as a caller
    may; eager's refusals (an output of a multi-output view, a view of a leaf) must be aotgrad's.
    """
    options = dict(
        create_graph=create_graph, under_no_grad=under_no_grad, touch_outputs=touch_outputs
    )
    ns = make_namespace
    if idiom == "function":
        eager, compiled = world(ns(), "function"), world(ns(), "function")
        compile_fn = aotgrad.aot_function
        _compare(idiom, eager, compiled, _quiet(compile_fn, compiled.target), **options)
    elif idiom in ("module", *HOLDERS):
        compile_fn = aotgrad.aot_module if idiom == "module" else aotgrad.aot_function
        eager, compiled = world(ns(), idiom), world(ns(), idiom)
        _compare(idiom, eager, compiled, _quiet(compile_fn, compiled.target), **options)
    elif idiom == "compile":
        form = holder if ns()["STATE"] else "function"
        eager, compiled = world(ns(), form), world(ns(), form)
        try:
            _compare(idiom, eager, compiled, fresh_compile(compiled.target), **options)
        except FuzzFailure:
            if not _dynamo_alone_fails(ns, form, options):
                raise
    elif idiom in ("trace", "trace_other"):
        # Trace on one call's inputs, call the Traced on fresh inputs: of the same
        # specialization (must equal eager), of another (must equal eager or refuse).
        captured = world(ns(), "function")
        traced = _quiet(aotgrad.trace, captured.target, *captured.args)
        spec = other if idiom == "trace_other" else None
        eager, compiled = world(ns(), "function", 0, 1, spec), world(ns(), "function", 0, 1, spec)
        _compare(idiom, eager, compiled, traced, **options)
    else:
        assert idiom == "trace_module", f"expected an idiom, got {idiom!r}"
        captured = world(ns(), "module")
        traced = _quiet(aotgrad.trace, captured.target, *captured.args)
        eager, fresh = world(ns(), "module", 0, 1), world(ns(), "module", 0, 1)
        state = model_tensors(captured.target)
        compiled = World(captured.target, fresh.args, [*state, *fresh.named[len(state) :]])
        _compare(idiom, eager, compiled, traced, **options)


def fresh_compile(f: Callable[..., Any]) -> Callable[..., Any]:
    # Dynamo keeps state across programs (automatic dynamic shapes when one source recurs).
    torch._dynamo.reset()
    return torch.compile(f, backend="aotgrad")


def _dynamo_alone_fails(ns: Callable[[], dict[str, Any]], form: str, options: Any) -> bool:
    """A torch.compile failure that Dynamo's own eager backend shares is not aotgrad's."""
    torch._dynamo.reset()
    eager, compiled = world(ns(), form), world(ns(), form)
    try:
        _compare(
            "compile", eager, compiled, torch.compile(compiled.target, backend="eager"), **options
        )
    except Exception:
        return True
    return False


def _quiet(compile_fn: Callable[..., Any], *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", DirectTracerBugWarning)  # Note [Choosing a tracer]
        try:
            return compile_fn(*args)
        except (AotgradError, FuzzFailure):
            raise
        except Exception as err:
            raise FuzzFailure("", error_signature(err), short_traceback(err)) from None


def _call(target: Any, args: tuple[Any, ...], under_no_grad: bool) -> Any:
    with torch.no_grad() if under_no_grad else contextlib.nullcontext():
        return target(*args)


def _compare(
    idiom: str,
    eager: World,
    compiled: World,
    compiled_fn: Callable[..., Any],
    *,
    create_graph: bool,
    under_no_grad: bool,
    touch_outputs: bool = False,
) -> None:
    rng = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            eager_out = _call(eager.target, eager.args, under_no_grad)
        except Exception as err:
            raise EagerFails(repr(err)) from err
        torch.random.set_rng_state(rng)
        compiled_out = _quiet(_call, compiled_fn, compiled.args, under_no_grad)
        checker = Checker()
        checker.outputs(eager_out, compiled_out, eager, compiled)
        checker.after_call(eager, compiled)
        if touch_outputs and not checker.mismatches:
            checker.touch(eager_out, compiled_out)
        if not checker.mismatches:  # gradients of mismatched outputs would repeat the news
            checker.gradients(eager_out, compiled_out, eager, compiled, create_graph)
    if checker.mismatches:
        text = "\n".join([f"{len(checker.mismatches)} mismatch(es)", *checker.mismatches])
        raise FuzzFailure(idiom, mismatch_signature(text), text)


# --- the comparison ------------------------------------------------------------------------------


class Checker:
    """Every difference between an eager world and a compiled world, as lines of text."""

    def __init__(self) -> None:
        self.mismatches: list[str] = []

    def outputs(self, eager: Any, compiled: Any, eager_world: World, compiled_world: World) -> None:
        eager_leaves, eager_spec = pytree.tree_flatten(eager)
        compiled_leaves, compiled_spec = pytree.tree_flatten(compiled)
        if eager_spec != compiled_spec:
            self.mismatches.append(f"output structure {compiled_spec} != eager {eager_spec}")
            return
        eager_aliases = _aliases(eager_leaves, eager_world)
        compiled_aliases = _aliases(compiled_leaves, compiled_world)
        for k, (e, c) in enumerate(zip(eager_leaves, compiled_leaves, strict=True)):
            name = f"output[{k}]"
            if not isinstance(e, torch.Tensor):
                if e != c:
                    self.mismatches.append(f"{name}: {c!r} != eager {e!r}")
                continue
            if not self.tensor(name, e, c):
                continue
            self.autograd_meta(name, e, c)
            if eager_aliases[k] != compiled_aliases[k]:
                self.mismatches.append(
                    f"{name}: aliases {compiled_aliases[k]} != eager {eager_aliases[k]}"
                )
            elif eager_aliases[k] is not None and e.stride() != c.stride():
                self.mismatches.append(f"{name}: stride {c.stride()} != eager {e.stride()}")

    def touch(self, eager_out: Any, compiled_out: Any) -> None:
        """Change each output in place (``mul_(1)``: same values, a new history) on both sides."""
        for k, (e, c) in enumerate(
            zip(pytree.tree_leaves(eager_out), pytree.tree_leaves(compiled_out), strict=True)
        ):
            if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
                continue
            raised = [_touch(t) for t in (e, c)]
            if (raised[0] is None) != (raised[1] is None):  # both refusing is a match
                self.mismatches.append(
                    f"output[{k}].mul_(1) after the call: {raised[1] or 'ran'}"
                    f" != eager {raised[0] or 'ran'}"
                )

    def after_call(self, eager: World, compiled: World) -> None:
        for (name, e), (_, c) in zip(eager.named, compiled.named, strict=True):
            where = f"input {name} after the call"
            if not self.tensor(where, e, c):
                continue
            if (e.stride(), e.storage_offset()) != (c.stride(), c.storage_offset()):
                self.mismatches.append(
                    f"{where}: stride/offset {c.stride()}/{c.storage_offset()}"
                    f" != eager {e.stride()}/{e.storage_offset()}"
                )
            self.autograd_meta(where, e, c)

    def autograd_meta(self, name: str, e: torch.Tensor, c: torch.Tensor) -> None:
        if e.requires_grad != c.requires_grad:
            self.mismatches.append(
                f"{name}: requires_grad {c.requires_grad} != eager {e.requires_grad}"
            )
        elif e.is_leaf != c.is_leaf:
            self.mismatches.append(f"{name}: is_leaf {c.is_leaf} != eager {e.is_leaf}")

    def tensor(self, name: str, e: torch.Tensor, c: Any) -> bool:
        """Compare type, shape, dtype and values; False if the rest is not comparable."""
        if not isinstance(c, torch.Tensor):
            self.mismatches.append(f"{name}: got {type(c).__name__}, eager gave a tensor")
            return False
        if e.shape != c.shape or e.dtype != c.dtype:
            self.mismatches.append(
                f"{name}: {c.dtype}{list(c.shape)} != eager {e.dtype}{list(e.shape)}"
            )
            return False
        if type(e) is not type(c):
            self.mismatches.append(f"{name}: a {type(c).__name__} != eager a {type(e).__name__}")
            return False
        placements = getattr(e, "placements", None), getattr(c, "placements", None)
        if placements[0] != placements[1]:  # a DTensor's
            self.mismatches.append(f"{name}: placements {placements[1]} != eager {placements[0]}")
        if is_subclass(e):  # its inner tensors (a DTensor's: to_local()): values, shapes, strides
            for inner, (ie, ic) in inner_tensors(e, c):
                if self.tensor(f"{name}.{inner}", ie, ic) and ie.stride() != ic.stride():
                    self.mismatches.append(
                        f"{name}.{inner}: stride {ic.stride()} != eager {ie.stride()}"
                    )
            return True
        try:
            torch.testing.assert_close(
                c.detach(), e.detach(), rtol=1.3e-6, atol=1e-5, equal_nan=True
            )
        except AssertionError as err:
            lines = [line for line in str(err).strip().splitlines() if line][:3]
            self.mismatches.append(f"{name}: values differ ({'; '.join(lines)})")
        return True

    def grad(self, name: str, e: torch.Tensor | None, c: torch.Tensor | None) -> None:
        if e is None or c is None:
            if (e is None) != (c is None):
                got, want = ("None" if x is None else "a tensor" for x in (c, e))
                self.mismatches.append(f"{name}: {got} != eager {want}")
            return
        self.tensor(name, e, c)

    def gradients(
        self, eager_out: Any, compiled_out: Any, eager: World, compiled: World, create_graph: bool
    ) -> None:
        pairs = []
        for i, (e, c) in enumerate(
            zip(pytree.tree_leaves(eager_out), pytree.tree_leaves(compiled_out), strict=True)
        ):
            if not (isinstance(e, torch.Tensor) and e.requires_grad and e.is_floating_point()):
                continue
            # A custom Function's view whose base changed in place: reading its grad_fn raises
            # (in eager and compiled alike); there is no graph to run backward on.
            e_fn, c_fn = _grad_fn_or_error(e), _grad_fn_or_error(c)
            if isinstance(e_fn, RuntimeError) or isinstance(c_fn, RuntimeError):
                if type(e_fn) is not type(c_fn):
                    self.mismatches.append(f"output[{i}].grad_fn: {c_fn!r} != eager {e_fn!r}")
                continue
            # a view made under no_grad of a tensor requiring grad: no graph to run backward on
            if not (e._is_view() and e_fn is None):
                pairs.append((e, c))
        leaves = _leaves(eager, compiled)
        if not pairs:
            return
        generator = torch.Generator().manual_seed(0)
        cotangents = [cotangent(e, generator) for e, _ in pairs]
        if not create_graph:
            _backward([e for e, _ in pairs], cotangents, eager=True)
            _backward([c for _, c in pairs], cotangents, eager=False)
            for name, e, c in leaves:
                self.grad(f"grad of {name}", e.grad, c.grad)
            return
        wrt = [(name, e, c) for name, e, c in leaves if e.requires_grad]
        if wrt:
            self._second_order(pairs, cotangents, wrt)

    def _second_order(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        cotangents: list[torch.Tensor],
        wrt: list[tuple[str, torch.Tensor, torch.Tensor]],
    ) -> None:
        """First-order gradients with ``create_graph=True``, then those of a weighted sum."""
        seconds = []
        for side in (0, 1):
            given = [t.clone().requires_grad_(True) for t in cotangents]
            inputs = [w[1 + side] for w in wrt]
            outputs = [p[side] for p in pairs]
            firsts = _grad(outputs, inputs, given, side == 0, create_graph=True)
            generator = torch.Generator().manual_seed(1)
            total = sum(
                ((g * cotangent(g, generator)).sum())  # a DTensor times a DTensor
                for g in firsts
                if g is not None and g.requires_grad
            )
            if side == 1:
                for (name, _, _), e, c in zip(wrt, seconds[0][0], firsts, strict=True):
                    self.grad(f"grad of {name}", e, c)
            again = (
                _grad([total], [*inputs, *given], None, side == 0)
                if isinstance(total, torch.Tensor)
                else [None] * (len(inputs) + len(given))
            )
            seconds.append((firsts, again))
        names = [f"second-order grad of {n}" for n, _, _ in wrt]
        names += [f"second-order grad of cotangent {k}" for k in range(len(cotangents))]
        for name, e, c in zip(names, seconds[0][1], seconds[1][1], strict=True):
            self.grad(name, e, c)


def cotangent(e: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A seeded random cotangent of ``e``'s type: a tensor subclass gets one of its own kind
    (aotgrad refuses a plain cotangent for a subclass output, which eager takes)."""
    if not is_subclass(e):
        return torch.randn(e.shape, generator=generator, dtype=e.dtype)
    names, context = e.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: _cotangent_or_same(getattr(e, n), generator) for n in names}
    return type(e).__tensor_unflatten__(inner, context, e.shape, e.stride())  # type: ignore[attr-defined,no-any-return]


def _cotangent_or_same(inner: Any, generator: torch.Generator) -> Any:
    """An inner tensor's cotangent; an inner object that is no tensor (a DTensor's mesh) as is."""
    return cotangent(inner, generator) if isinstance(inner, torch.Tensor) else inner


def inner_names(t: torch.Tensor) -> list[str]:
    """The names of ``t``'s inner tensors (a DTensor flattens its device mesh too: left out)."""
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [n for n in names if isinstance(getattr(t, n), torch.Tensor)]


def _touch(t: torch.Tensor) -> str | None:
    """``t.mul_(1)``: None, or the error's first words (what kind of refusal it was)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.mul_(1)
    except Exception as err:
        return f"{type(err).__name__}: {' '.join(str(err).split()[:8])}"
    return None


def is_subclass(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def inner_tensors(e: torch.Tensor, c: torch.Tensor) -> list[tuple[str, tuple[Any, Any]]]:
    return [(n, (getattr(e, n), getattr(c, n))) for n in inner_names(e)]


def storage_keys(t: torch.Tensor) -> set[Any]:
    """The storages under ``t``: its own, or its inner tensors' for a tensor subclass."""
    if is_subclass(t):
        return set().union(*(storage_keys(getattr(t, n)) for n in inner_names(t)))
    return {storage_key(t)}


def _grad_fn_or_error(t: Any) -> Any:
    try:
        return t.grad_fn if isinstance(t, torch.Tensor) else None
    except RuntimeError as err:
        return err


def _leaves(eager: World, compiled: World) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The named tensors that are leaves (holding ``.grad``), each tensor once."""
    seen: set[int] = set()
    leaves = []
    for (name, e), (_, c) in zip(eager.named, compiled.named, strict=True):
        if e.is_leaf and id(e) not in seen:
            seen.add(id(e))
            leaves.append((name, e, c))
    return leaves


@contextlib.contextmanager
def _engine_errors(eager: bool) -> Iterator[None]:
    """What the autograd engine raises: eager's own failure, or a fuzz failure of aotgrad's
    (an AotgradError passes as the refusal it is)."""
    try:
        yield
    except AotgradError:
        raise
    except Exception as err:
        if eager:
            raise EagerFails(repr(err)) from err
        raise FuzzFailure("", error_signature(err), short_traceback(err)) from None


def _backward(outputs: list[torch.Tensor], cotangents: list[torch.Tensor], eager: bool) -> None:
    with _engine_errors(eager):
        torch.autograd.backward(outputs, cotangents)


def _grad(
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    cotangents: list[torch.Tensor] | None,
    eager: bool,
    create_graph: bool = False,
) -> list[torch.Tensor | None]:
    with _engine_errors(eager):
        return list(
            torch.autograd.grad(
                outputs, inputs, cotangents, create_graph=create_graph, allow_unused=True
            )
        )


def _aliases(outputs: list[Any], world: World) -> list[tuple[str, Any, bool] | None]:
    """Per output: the named tensor or earlier output it shares memory with, and whether it *is* it."""
    seen: list[tuple[set[Any], int, torch.Tensor]] = []
    result: list[tuple[str, Any, bool] | None] = []
    for k, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            result.append(None)
            continue
        key = storage_keys(out)
        alias = next(
            (("input", name, out is t) for name, t in world.named if storage_keys(t) & key), None
        )
        if alias is None:
            alias = next((("output", j, out is o) for other, j, o in seen if other & key), None)
        seen.append((key, k, out))
        result.append(alias)
    return result


# --- failure signatures: what makes two failures the same -----------------------------------------

_NUMBERS = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")


def mismatch_signature(text: str) -> str:
    kinds = set()
    for line in text.splitlines()[1:]:
        line = line.split(" (")[0]
        line = re.sub(r"^(output|input|grad of|second-order grad of)[^:]*:", r"\1:", line)
        line = re.sub(r"torch\.\w+\[[^\]]*\] != eager torch\.\w+\[[^\]]*\]", "shape differs", line)
        kinds.add(_NUMBERS.sub("N", line)[:80])
    return "mismatch: " + "; ".join(sorted(kinds))


def error_signature(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    where = "?"
    for frame in reversed(frames):
        if "aotgrad" in frame.filename or "torch" in frame.filename:
            where = f"{os.path.basename(frame.filename)}:{frame.name}"
            break
    message = str(err).splitlines()[0] if str(err) else ""
    message = _NUMBERS.sub("N", re.sub(r"<[^>]*>", "<...>", message))[:70]
    return f"{type(err).__name__} at {where}: {message}"


def short_traceback(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)[-12:])
