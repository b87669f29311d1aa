"""CUDA checks of what the CPU suite cannot reach; run on a machine with one NVIDIA GPU.

    python tests/gpu_checks.py          # prints one line per check, exits 1 if any failed

Each check compares a compiled function with eager PyTorch on CUDA tensors: reseeds
replayed on the CUDA generator, value checks (``validate_args``) that fail on the device
without poisoning the CUDA context, concurrent first calls from threads, side effects
stored with real CUDA tensors, and reseeds the trace cannot see refused.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable

import torch
import torch.distributions as D
import torch.nn.functional as F

import aotgrad

DEVICE = "cuda"
CHECKS: list[Callable[[], None]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


def run(fn: Callable[[], None]) -> str:
    try:
        fn()
    except Exception as e:
        return "FAILED " + "".join(traceback.format_exception_only(type(e), e)).strip()[:600]
    return "ok"


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), (a, b)


@check
def reseed_before_random_ops_replays_on_cuda() -> None:
    def f(x):
        torch.manual_seed(0)  # seeds every device, as eager's
        return F.dropout(x, 0.5) * torch.rand_like(x)

    def g(x):
        torch.cuda.manual_seed(3)
        return F.dropout(x, 0.5) + torch.rand_like(x)

    for fn in (f, g):
        compiled = aotgrad.aot_function(fn)
        x = torch.ones(256, device=DEVICE, requires_grad=True)
        for i in range(3):
            torch.cuda.manual_seed(100 + i)
            got = compiled(x)
            state_got = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(100 + i)
            expected = fn(x)
            _same(got, expected)
            _same(state_got, torch.cuda.get_rng_state())


@check
def dropout_masks_are_eagers_on_cuda() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).to(DEVICE)
    compiled = aotgrad.aot_module(model)
    x = torch.randn(4, 8, device=DEVICE)
    for _ in range(2):
        state = torch.cuda.get_rng_state()
        got = compiled(x)
        torch.cuda.set_rng_state(state)
        _same(got, model(x))


@check
def a_failed_value_check_raises_and_cuda_goes_on() -> None:
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


@check
def concurrent_first_calls_match_eager_on_cuda() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model = model.to(DEVICE)
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
        t.join(timeout=300)
    assert not errors, errors
    for i, x in enumerate(inputs):
        torch.testing.assert_close(results[i], model(x))


@check
def hooks_record_real_cuda_activations() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).to(DEVICE)
    acts: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, i, out: acts.append(out.detach()))
    compiled = aotgrad.aot_module(model)
    for _ in range(2):
        x = torch.randn(2, 4, device=DEVICE)
        compiled(x)
        expected = model[0](x).detach()
        acts.pop()  # the eager call's own record
        got = acts.pop()
        assert type(got) is torch.Tensor and got.device.type == "cuda", type(got)
        torch.testing.assert_close(got, expected)


@check
def a_direct_reseed_of_the_cuda_generator_is_refused() -> None:
    def f(x):
        torch.cuda.default_generators[0].manual_seed(0)
        return F.dropout(x, 0.5)

    try:
        aotgrad.aot_function(f)(torch.ones(8, device=DEVICE))
    except aotgrad.errors.UnsupportedOpError as e:
        assert "reseeded" in str(e), e
    else:
        raise AssertionError("a direct reseed of the CUDA generator was baked in")


@check
def sdpa_backends_are_keyed_on_cuda() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    compiled = aotgrad.aot_function(lambda q: F.scaled_dot_product_attention(q, q, q).sum())
    compiled(q).backward()
    with sdpa_kernel(SDPBackend.MATH):
        compiled(q).backward()
    info = aotgrad.cache_info(compiled)
    assert info.misses == 2, info


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, pid {os.getpid()}")
    failed = 0
    for fn in CHECKS:
        outcome = run(fn)
        failed += outcome != "ok"
        print(f"{fn.__name__}: {outcome}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
