"""``make gpu-check``: what the CPU suite cannot reach, on a machine with one NVIDIA GPU.

    python tests/gpu_checks.py                  # every check; one table; exit 1 on any mismatch
    python tests/gpu_checks.py --only dropout   # the checks whose name contains "dropout"
    python tests/gpu_checks.py --list           # the checks' names
    AOTGRAD_GPU_CHECK_DEVICE=cpu python tests/gpu_checks.py   # every check on CPU (debugging)

Each check compares aotgrad with eager PyTorch (or ``torch.compile``, or PyTorch's partitioner)
on CUDA tensors, in groups:

- ``rng``: reseeds replayed on the CUDA generator, dropout masks, the CUDA generator's state
  (seed and Philox offset) after each forward and backward over three steps through a
  non-reentrant (and a reentrant) checkpoint with dropout inside, attention dropout drawn in a
  fused kernel; with them, value checks failing on the device,
  concurrent first calls, hooks given real CUDA tensors, refused direct reseeds, SDPA backends.
- ``library``: ``aot_module(model.cuda())`` on a library model with dropout, against eager.
- ``inductor``: a GPT training step through ``aotgrad.compilers.inductor`` against
  ``torch.compile`` (values within tolerance; the time ratio per step is reported, never judged).
- ``memory``: peak CUDA memory of a training step under aotgrad's ``mincut`` and ``budget(0.5)``
  plans and PyTorch's ``min_cut_rematerialization_partition`` (at its default and at
  ``activation_memory_budget=0.5``) on the same model: reported with their ratio; only the
  values are judged.
- ``models``: the real-model suite's fast subset (``tests/test_real_models.py`` ``FAST``) through
  its own ``compare``: outputs, every gradient, buffers, tied weights.

A check's result is ``ok``, ``FAILED`` (a mismatch, or an error where none is expected: the exit
status is 1), ``skipped`` (its package is not installed, or the installed version cannot build the model
or lacks a name the cell uses: aotgrad never ran; or it needs CUDA and runs on CPU),
``xfail`` (a cell of ``KNOWN_FAILURES`` refused loudly, as on CPU; a value mismatch there is
still ``FAILED``) or ``xpass``. One check failing never stops the next; each has a time limit,
and the whole run stops starting checks after ``TOTAL_S`` seconds (the rest are ``not run``).
Without CUDA (and without the CPU switch) it says so and exits 0. The disk cache is off.

On CUDA, TF32 is off (cuDNN's and cuBLAS's): the comparisons use the float32 tolerances of the
CPU suite, which TF32 convolutions would not meet. The lent GPU machines have no network and
their own torch: ``python3 tests/gpu_checks.py`` from the checkout (it imports ``src/aotgrad``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # the checkout's aotgrad and the tests' helpers, before any install
    sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]
    os.environ["AOTGRAD_CACHE"] = "0"

import torch  # noqa: E402
import torch.distributions as D  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import aotgrad  # noqa: E402

DEVICE = os.environ.get("AOTGRAD_GPU_CHECK_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
# In seconds: the run starts no check after TOTAL_S, and stops one at its limit (CHECK_S
# unless it says otherwise; a real-model cell MODEL_CELL_S): `make gpu-check` ends within
# 8 minutes (400 + 60 s at worst; under 2 minutes on CPU here, Inductor included).
TOTAL_S = 400
CHECK_S = 120
MODEL_CELL_S = 60
LIBRARIES = ("transformers", "timm", "torchvision")


class Skip(Exception):
    """This check cannot run here; the message says why (a missing package, CUDA only)."""


class KnownFailure(Exception):
    """A cell of ``KNOWN_FAILURES`` refused loudly, as it does on CPU."""


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], str | None]  # raises on a mismatch; returns the numbers to report
    cuda_only: bool = False
    limit_s: int = CHECK_S


@dataclass(frozen=True)
class Row:
    check: str
    result: str  # ok, FAILED, skipped, xfail, xpass, not run
    detail: str


CHECKS: list[Check] = []


def check(
    group: str, cuda_only: bool = False, limit_s: int = CHECK_S
) -> Callable[[Callable[[], str | None]], Callable[[], str | None]]:
    def register(fn: Callable[[], str | None]) -> Callable[[], str | None]:
        CHECKS.append(Check(f"{group}: {fn.__name__}", fn, cuda_only, limit_s))
        return fn

    return register


# ---------------------------------------------------------------- the device's generator


def _manual_seed(seed: int) -> None:
    """Seed the device's generator only (``torch.cuda.manual_seed`` on CUDA)."""
    (torch.cuda.manual_seed if ON_CUDA else torch.manual_seed)(seed)


def _rng_state() -> torch.Tensor:
    """The device generator's state: on CUDA its seed and Philox offset."""
    return torch.cuda.get_rng_state() if ON_CUDA else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    (torch.cuda.set_rng_state if ON_CUDA else torch.set_rng_state)(state)


def _default_generator() -> torch.Generator:
    return torch.cuda.default_generators[0] if ON_CUDA else torch.default_generator


def _sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def _same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Assert equal, bit for bit; the message counts the differences (a CUDA generator's state
    reads as its seed and Philox offset)."""
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, eager {tuple(expected.shape)}")
    if torch.equal(got, expected):
        return
    if ON_CUDA and got.dtype == torch.uint8 and got.numel() == 16:
        seeds = (got.view(torch.int64).tolist(), expected.view(torch.int64).tolist())
        raise AssertionError(f"{what}: (seed, offset) {seeds[0]}, eager {seeds[1]}")
    differ = int((got != expected).sum())
    raise AssertionError(f"{what}: {differ}/{got.numel()} elements differ from eager's")


def _close(
    got: Sequence[torch.Tensor | None],
    expected: Sequence[torch.Tensor | None],
    what: str,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> float:
    """Assert ``got`` matches ``expected`` pairwise; returns the largest absolute difference."""
    assert len(got) == len(expected), f"{what}: {len(got)} tensors, expected {len(expected)}"
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert (g is None) == (e is None), (
            f"{what} [{i}]: got {g is not None}, eager {e is not None}"
        )
        if g is None or e is None:
            continue
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol, msg=_prefixed(f"{what} [{i}]"))
        if g.numel():
            worst = max(worst, float((g.detach() - e.detach()).abs().max()))
    return worst


def _prefixed(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()]


# ---------------------------------------------------------------- rng and CUDA semantics


@check("rng")
def reseed_before_random_ops_replays() -> None:
    def f(x):
        torch.manual_seed(0)  # seeds every device, as eager's
        return F.dropout(x, 0.5) * torch.rand_like(x)

    def g(x):
        _manual_seed(3)
        return F.dropout(x, 0.5) + torch.rand_like(x)

    for fn in (f, g):
        compiled = aotgrad.aot_function(fn)
        x = torch.ones(256, device=DEVICE, requires_grad=True)
        for i in range(3):
            _manual_seed(100 + i)
            got = compiled(x)
            state_got = _rng_state()
            _manual_seed(100 + i)
            expected = fn(x)
            _same(got, expected, f"{fn.__name__} call {i}")
            _same(state_got, _rng_state(), f"{fn.__name__} call {i} generator state")


@check("rng")
def dropout_masks_are_eagers() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).to(DEVICE)
    compiled = aotgrad.aot_module(model)
    x = torch.randn(4, 8, device=DEVICE)
    for _ in range(2):
        state = _rng_state()
        got = compiled(x)
        _set_rng_state(state)
        _same(got, model(x), "output")


class _DropoutBlock(nn.Module):
    """Linear, dropout, GELU, ``rand_like`` noise, Linear: two random draws per call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.dropout(self.a(x), 0.3, training=self.training))
        return self.b(h + 0.1 * torch.rand_like(h))


class _Checkpointed(nn.Module):
    """Dropout, then a non-reentrant checkpoint of a block with dropout inside, then dropout:
    if the recompute drew other numbers than the forward, or left the generator elsewhere
    than eager's does, the gradients or the next call's masks differ."""

    def __init__(self, use_reentrant: bool, width: int = 64) -> None:
        super().__init__()
        self.block = _DropoutBlock(width)
        self.head = nn.Linear(width, width)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, 0.2, training=self.training)
        h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return F.dropout(self.head(h), 0.2, training=self.training)


def _rng_stream(model: nn.Module, fn: Callable[..., Any], x: torch.Tensor, steps: int) -> list[Any]:
    """Per step: output, gradients, generator state after the forward and after the backward
    (no reseed between steps: each step draws where the last one left the generator)."""
    found = []
    for _ in range(steps):
        out = fn(x)
        after_forward = _rng_state()
        (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
        found.append((out.detach(), _grads(model), after_forward, _rng_state()))
        model.zero_grad(set_to_none=True)
    return found


def _checkpoint_rng(use_reentrant: bool) -> str:
    torch.manual_seed(0)
    eager = _Checkpointed(use_reentrant).to(DEVICE)
    ours = copy.deepcopy(eager)
    compiled = aotgrad.aot_module(ours)
    # A reentrant checkpoint gives its block's parameters gradients only when its input
    # requires grad (in eager too).
    x = torch.randn(32, 64, device=DEVICE, requires_grad=use_reentrant)
    _manual_seed(7)
    start = _rng_state()
    expected = _rng_stream(eager, eager, x, steps=3)
    _set_rng_state(start)
    got = _rng_stream(ours, compiled, x, steps=3)
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        _same(g[0] == 0, e[0] == 0, f"step {i} dropout mask of the output")
        worst = max(worst, _close([g[0]], [e[0]], f"step {i} output"))
        worst = max(worst, _close(g[1], e[1], f"step {i} gradients", rtol=1e-4, atol=1e-5))
        _same(g[2], e[2], f"step {i} generator state after the forward")
        _same(g[3], e[3], f"step {i} generator state after the backward (checkpoint recompute)")
    return f"3 steps: masks, generator state equal; max |diff| {worst:.2g}"


@check("rng")
def checkpoint_recompute_keeps_eagers_generator_offsets() -> str:
    """Non-reentrant ``torch.utils.checkpoint`` with dropout inside."""
    return _checkpoint_rng(use_reentrant=False)


@check("rng")
def reentrant_checkpoint_recompute_keeps_eagers_generator_offsets() -> str:
    return _checkpoint_rng(use_reentrant=True)


@check("rng")
def attention_dropout_draws_eagers_numbers() -> str:
    """``scaled_dot_product_attention(dropout_p=...)``: on CUDA a fused kernel draws its mask
    from the generator's Philox state; the compiled call must draw the same one."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (
        torch.randn(2, 2, 16, 8, device=DEVICE, generator=g).requires_grad_() for _ in range(3)
    )

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    compiled = aotgrad.aot_function(f)
    worst = 0.0
    for i in range(2):
        _manual_seed(11 + i)
        expected = f(q, k, v)
        expected_state = _rng_state()
        expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        _manual_seed(11 + i)
        got = compiled(q, k, v)
        _same(_rng_state(), expected_state, f"call {i} generator state")
        got_grads = torch.autograd.grad(got.sum(), (q, k, v))
        worst = max(
            worst,
            _close([got, *got_grads], [expected, *expected_grads], f"call {i}", 1e-4, 1e-5),
        )
    return f"max |diff| {worst:.2g}"


@check("rng")
def a_failed_value_check_raises_and_the_device_goes_on() -> None:
    def f(loc, scale, value):
        return D.Normal(loc, scale).log_prob(value).sum()

    compiled = aotgrad.aot_function(f)
    ones = torch.ones(3, device=DEVICE)
    torch.testing.assert_close(compiled(ones, ones, ones), f(ones, ones, ones))
    try:
        compiled(ones, -ones, ones)
    except RuntimeError as e:
        assert "a check failed" in str(e), e
    else:
        raise AssertionError("an invalid scale did not raise")
    assert torch.ones(2, device=DEVICE).sum().item() == 2.0  # the context still works


@check("rng")
def concurrent_first_calls_match_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(DEVICE)
    compiled = aotgrad.aot_module(model)
    inputs = [torch.randn(n, 16, device=DEVICE) for n in range(1, 9)]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(inputs))

    def call(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            results[i] = compiled(inputs[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not errors, errors
    for i, x in enumerate(inputs):
        torch.testing.assert_close(results[i], model(x))


@check("rng")
def hooks_record_real_device_activations() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(DEVICE)
    acts: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, i, out: acts.append(out.detach()))
    compiled = aotgrad.aot_module(model)
    for _ in range(2):
        x = torch.randn(2, 4, device=DEVICE)
        compiled(x)
        expected = model[0](x).detach()
        acts.pop()  # the eager call's own record
        got = acts.pop()
        assert type(got) is torch.Tensor and got.device.type == DEVICE, (type(got), got.device)
        torch.testing.assert_close(got, expected)


@check("rng")
def a_direct_reseed_of_the_generator_is_refused() -> None:
    def f(x):
        _default_generator().manual_seed(0)
        return F.dropout(x, 0.5)

    try:
        aotgrad.aot_function(f)(torch.ones(8, device=DEVICE))
    except aotgrad.errors.UnsupportedOpError as e:
        assert "reseeded" in str(e), e
    else:
        raise AssertionError("a direct reseed of the device's generator was baked in")


@check("rng")
def sdpa_backends_are_keyed() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    compiled = aotgrad.aot_function(lambda q: F.scaled_dot_product_attention(q, q, q).sum())
    compiled(q).backward()
    with sdpa_kernel(SDPBackend.MATH):
        compiled(q).backward()
    info = aotgrad.cache_info(compiled)
    assert info.misses == 2, info


# ---------------------------------------------------------------- library models


def _missing_library(e: ImportError) -> str | None:
    """The library model package an import failed in, if it was one (not aotgrad, not torch)."""
    root = (e.name or "").split(".")[0]
    return root if root in LIBRARIES else None


def _build(name: str, dropout: float) -> Any:
    """The library model ``name`` on the device; Skip when its package is not installed."""
    from library_models import build, on_device

    try:
        case = build(name, dropout=dropout)
    except ModuleNotFoundError as e:
        if (library := _missing_library(e)) is None:
            raise
        raise Skip(f"{library} is not installed") from None
    except Exception as e:
        # The library's version here takes other config arguments, say: aotgrad never ran.
        raise Skip(f"{name} cannot be built here ({_versions()}): {_one_line(e)}") from None
    return on_device(case, DEVICE)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for library in LIBRARIES:
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{library} {version(library)}")
    return ", ".join(found)


def _one_line(e: BaseException) -> str:
    message = "".join(traceback.format_exception_only(type(e), e)).strip()
    return " ".join(message.split())[:400]


@check("library")
def aot_module_of_a_library_model_with_dropout() -> str:
    """``aot_module(model.cuda())`` with dropout in train mode: outputs, gradients and buffers
    equal eager's on two calls; the first of GPT-2, torchvision's ViT, timm's ViT installed."""
    real = _real_models()

    missing = []
    for name in ("gpt2", "tv_vit", "vit"):
        try:
            case = _build(name, dropout=0.1)
        except Skip as e:
            missing.append(str(e))
            continue
        real.compare(case, real._aot_module(), [case.inputs, case.inputs])
        return f"{name}, dropout 0.1, 2 calls"
    raise Skip("; ".join(missing))


class _Anything:
    """Stands in for pytest where it is not installed (the lent GPU machines may lack it):
    ``tests/test_real_models.py`` uses pytest's marks at import, this script only its helpers."""

    def __getattr__(self, name: str) -> _Anything:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: the function itself
        return self


def _real_models() -> Any:
    """``tests/test_real_models.py``: its FAST subset, KNOWN_FAILURES and ``compare``."""
    try:
        import pytest  # noqa: F401
    except ModuleNotFoundError:
        sys.modules["pytest"] = _Anything()  # type: ignore[assignment]
    import test_real_models

    return test_real_models


def _model_cell(model: str, kind: str) -> Callable[[], str | None]:
    def run() -> str | None:
        real = _real_models()
        known = real.KNOWN_FAILURES.get((model, kind))
        try:
            real.run_check(model, kind, make=_build)
        except Skip:
            raise
        except ImportError as e:
            # Another version of the library lacks a name the cell uses (timm's checkpoint
            # switch, say); an import failing anywhere else (aotgrad, torch) is a failure.
            if _missing_library(e) is None:
                raise
            raise Skip(f"the installed library lacks it ({_versions()}): {_one_line(e)}") from None
        except AssertionError:
            raise  # a mismatch: FAILED, known failure or not (those are loud refusals)
        except Exception as e:
            if known is None:
                raise
            raise KnownFailure(f"{type(e).__name__} ({known})") from None
        if known is not None:
            return f"xpass: known to fail on CPU ({known})"
        return None

    return run


def _register_model_cells() -> None:
    real = _real_models()

    for model in real.MODELS:
        for kind in real.CHECKS:
            if (model, kind) in real.FAST and (model, kind) not in real.NOT_APPLICABLE:
                CHECKS.append(
                    Check(f"models: {model}-{kind}", _model_cell(model, kind), limit_s=MODEL_CELL_S)
                )


# ---------------------------------------------------------------- inductor and memory


def _gpt(tied: bool = True) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The benchmarks' GPT (pre-LN), 2 blocks of width 256 on CUDA; tiny on CPU. PyTorch's
    ``aot_module`` refuses tied weights (``functional_call``): the memory checks untie them."""
    from models import GPT

    torch.manual_seed(0)
    vocab, dim, blocks, seq, batch = (1000, 256, 2, 128, 4) if ON_CUDA else (64, 32, 1, 16, 2)
    model = GPT(vocab=vocab, dim=dim, heads=4, blocks=blocks, context=seq, tied=tied)
    model = model.to(DEVICE)
    idx = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    return model, (idx, torch.randint(0, vocab, (batch, seq), device=DEVICE))


def _train_step(model: nn.Module, fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """Loss and every gradient of one step; the gradients are cleared for the next."""
    model.zero_grad(set_to_none=True)
    loss = fn(*args)
    loss.backward()
    found = [loss.detach(), *_grads(model)]
    model.zero_grad(set_to_none=True)
    return found


def _seconds(step: Callable[[], Any]) -> float:
    """Wall-clock seconds of ``step``, the device's queue drained before and after."""
    _sync()
    start = time.perf_counter()
    step()
    _sync()
    return time.perf_counter() - start


@check("inductor", limit_s=240)
def training_step_with_inductor_against_torch_compile() -> str:
    """Loss and gradients of a GPT step: aotgrad + Inductor against ``torch.compile`` and eager
    (Inductor fuses and reorders reductions: rtol 1e-3, atol 1e-5); the median step time after
    warm-up, the tools alternating step by step, is reported as a ratio."""
    if not ON_CUDA and os.environ.get("AOTGRAD_GPU_CHECK_INDUCTOR") == "0":
        raise Skip("AOTGRAD_GPU_CHECK_INDUCTOR=0: Inductor on CPU left out")
    torch._dynamo.reset()
    model, args = _gpt()
    ours_model, theirs_model = copy.deepcopy(model), copy.deepcopy(model)
    inductor = aotgrad.compilers.inductor
    ours = aotgrad.aot_module(ours_model, inductor, inductor)
    theirs = torch.compile(theirs_model)
    expected = _train_step(model, model, args)
    got: list[Any] = []
    reference: list[Any] = []
    ours_compile = _seconds(lambda: got.extend(_train_step(ours_model, ours, args)))
    theirs_compile = _seconds(lambda: reference.extend(_train_step(theirs_model, theirs, args)))
    tol = {"rtol": 1e-3, "atol": 1e-5}
    against_compile = _close(got, reference, "aotgrad+inductor vs torch.compile", **tol)
    against_eager = _close(got, expected, "aotgrad+inductor vs eager", **tol)
    for _ in range(2):  # warm-up beyond the compiling call
        _train_step(ours_model, ours, args)
        _train_step(theirs_model, theirs, args)
    ours_s, theirs_s = [], []
    for _ in range(10):
        ours_s.append(_seconds(lambda: _train_step(ours_model, ours, args)))
        theirs_s.append(_seconds(lambda: _train_step(theirs_model, theirs, args)))
    a, b = statistics.median(ours_s), statistics.median(theirs_s)
    return (
        f"step {a * 1e3:.2f} ms vs torch.compile {b * 1e3:.2f} ms: ratio {a / b:.2f}"
        f" (median of 10); first step {ours_compile:.1f} s vs {theirs_compile:.1f} s;"
        f" max |diff| {against_compile:.2g} vs compile, {against_eager:.2g} vs eager"
    )


def _pytorch_partitioned(model: nn.Module, budget: float | None) -> Callable[..., Any]:
    """PyTorch's ``aot_module`` with ``min_cut_rematerialization_partition`` (as ``bench/``),
    graphs run as they are; compiled by its first call, under ``budget`` when given. Its
    backward graph's saved bytes, counted as ``tests/reference.py`` does, go to ``.saved``."""
    import functorch.compile as fc
    from torch._functorch import config as functorch_config

    from reference import backward_stats

    saved: list[int] = []

    def bw_compiler(gm: Any, example_inputs: Any) -> Any:
        saved.append(backward_stats(gm)[0])
        return fc.make_boxed_func(gm)

    compiled = fc.aot_module(
        model,
        fw_compiler=lambda gm, example_inputs: fc.make_boxed_func(gm),
        bw_compiler=bw_compiler,
        partition_fn=fc.min_cut_rematerialization_partition,
    )
    patch = (
        functorch_config.patch(activation_memory_budget=budget)
        if budget is not None
        else contextlib.nullcontext()
    )

    def first_call_compiles(*args: Any) -> Any:
        with patch:
            return compiled(*args)

    first_call_compiles.compiled = compiled  # type: ignore[attr-defined]
    first_call_compiles.saved = saved  # type: ignore[attr-defined]
    return first_call_compiles


def _peak_bytes(model: nn.Module, fn: Callable[..., Any], args: Sequence[Any]) -> int | None:
    """Peak CUDA memory of one training step above what was allocated before it (None on CPU)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if not ON_CUDA:
        _train_step(model, fn, args)
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(*args).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    model.zero_grad(set_to_none=True)
    return peak


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MB"


def _memory_row(ours_plan: Any, budget: float | None) -> str:
    """One plan of aotgrad's against PyTorch's min-cut at the same budget, on one GPT."""
    model, args = _gpt(tied=False)
    expected = _train_step(model, model, args)
    eager_peak = _peak_bytes(model, model, args)
    ours_model, theirs_model = copy.deepcopy(model), copy.deepcopy(model)
    ours = aotgrad.aot_module(ours_model, partition=ours_plan)
    theirs = _pytorch_partitioned(theirs_model, budget)
    worst = 0.0
    for name, m, fn in (("aotgrad", ours_model, ours), ("pytorch", theirs_model, theirs)):
        got = _train_step(m, fn, args)  # compiles; then the values against eager
        worst = max(worst, _close(got, expected, f"{name} vs eager", rtol=1e-4, atol=1e-5))
    ours_peak = _peak_bytes(ours_model, ours, args)
    theirs_peak = _peak_bytes(theirs_model, theirs.compiled, args)  # type: ignore[attr-defined]
    ratio = "" if ours_peak is None or not theirs_peak else f", ratio {ours_peak / theirs_peak:.2f}"
    ours_saved = aotgrad.trace(ours_model, *args, partition=ours_plan).partitioned.saved_bytes
    (theirs_saved,) = theirs.saved  # type: ignore[attr-defined]
    return (
        f"peak {_mb(ours_peak)} vs pytorch {_mb(theirs_peak)}{ratio} (eager {_mb(eager_peak)});"
        f" planned saved {_mb(ours_saved)} vs {_mb(theirs_saved)}; values max |diff| {worst:.2g}"
    )


@check("memory", limit_s=180)
def peak_memory_mincut_against_pytorch_min_cut() -> str:
    return _memory_row("mincut", None)


@check("memory", limit_s=180)
def peak_memory_budget_half_against_pytorch_budget_half() -> str:
    return _memory_row(aotgrad.budget(0.5), 0.5)


# ---------------------------------------------------------------- running and the table


class _TimeLimit(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Raise _TimeLimit in the main thread after ``seconds`` (checked between Python bytecodes)."""

    def expire(signum: int, frame: Any) -> None:
        raise _TimeLimit(f"still running after {seconds} s")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_check(c: Check) -> Row:
    """One check, isolated: whatever it raises becomes its row."""
    if c.cuda_only and not ON_CUDA:
        return Row(c.name, "skipped", "CUDA only")
    start = time.perf_counter()
    try:
        with _time_limit(c.limit_s):
            detail = c.run()
    except Skip as e:
        return Row(c.name, "skipped", str(e))
    except KnownFailure as e:
        return Row(c.name, "xfail", str(e))
    except _TimeLimit as e:
        return Row(c.name, "FAILED", str(e))
    except Exception as e:
        print(f"{c.name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return Row(c.name, "FAILED", _one_line(e))
    finally:
        _sync_quietly()
    seconds = time.perf_counter() - start
    if detail and detail.startswith("xpass: "):
        return Row(c.name, "xpass", detail.removeprefix("xpass: "))
    return Row(c.name, "ok", f"{detail + '; ' if detail else ''}{seconds:.1f} s")


def _sync_quietly() -> None:
    with contextlib.suppress(Exception):  # a broken context shows in the next check's row
        _sync()


def run_all(checks: Sequence[Check], total_s: float = TOTAL_S) -> list[Row]:
    rows = []
    start = time.perf_counter()
    for c in checks:
        if time.perf_counter() - start > total_s:
            rows.append(Row(c.name, "not run", f"the run's {total_s:.0f} s were spent"))
            continue
        print(f"running {c.name}", file=sys.stderr, flush=True)
        rows.append(run_check(c))
    return rows


def table(rows: Sequence[Row]) -> str:
    header = Row("check", "result", "detail")
    width = [
        max(len(r.check) for r in (header, *rows)),
        max(len(r.result) for r in (header, *rows)),
    ]
    lines = [
        f"{r.check:<{width[0]}} | {r.result:<{width[1]}} | {r.detail}" for r in (header, *rows)
    ]
    lines.insert(1, f"{'-' * width[0]}-+-{'-' * width[1]}-+-{'-' * 6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the checks whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the checks' names")
    options = parser.parse_args(argv)
    if DEVICE not in ("cuda", "cpu"):
        print(f"AOTGRAD_GPU_CHECK_DEVICE={DEVICE!r}: expected cuda or cpu", file=sys.stderr)
        return 2
    if ON_CUDA and not torch.cuda.is_available() and not options.list:
        print(
            "gpu-check skipped: no CUDA device here (AOTGRAD_GPU_CHECK_DEVICE=cpu runs the checks on CPU)"
        )
        return 0
    _register_model_cells()
    checks = [c for c in CHECKS if options.only is None or options.only in c.name]
    if options.list:
        print("\n".join(c.name for c in checks))
        return 0
    if not checks:
        print(f"no check's name contains {options.only!r} (--list names them)", file=sys.stderr)
        return 2
    if ON_CUDA:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        where = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        where = "CPU (AOTGRAD_GPU_CHECK_DEVICE=cpu)"
    start = time.perf_counter()
    rows = run_all(checks)
    counts = {k: sum(r.result == k for r in rows) for k in dict.fromkeys(r.result for r in rows)}
    print(f"gpu-check: torch {torch.__version__}, Python {sys.version.split()[0]}, {where}")
    print(table(rows))
    print(
        ", ".join(f"{n} {k}" for k, n in counts.items()) + f"; {time.perf_counter() - start:.0f} s"
    )
    return exit_status(rows)


def exit_status(rows: Sequence[Row]) -> int:
    """1 when any check failed (a mismatch, or an error where none was expected), else 0."""
    return 1 if any(r.result == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
