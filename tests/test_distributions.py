"""torch.distributions with their default ``validate_args``, and istft: captured with their
value checks kept as asserts in the graph (Note [Host checks] in capture/user_state/host_checks.py)."""

from __future__ import annotations

import pytest
import torch
from torch import distributions as D

import aotgrad

TRACERS = ["auto", "full"]


@pytest.fixture(autouse=True)
def _validation_on():
    """The default ``validate_args`` is on, as in a fresh process: the first
    ``torch.compile`` of a process turns it off for good (Dynamo's ``TorchPatcher``),
    and another test of the suite may have compiled before these run."""
    before = D.Distribution._validate_args
    D.Distribution.set_default_validate_args(True)
    yield
    D.Distribution.set_default_validate_args(before)


def _normal(loc, scale, value):
    d = D.Normal(loc, scale)
    return d.log_prob(value).sum() + d.entropy().sum(), d.rsample((2,))


def _categorical(logits, value):
    d = D.Categorical(logits=logits)
    return d.log_prob(value).sum() + d.entropy().sum()


def _bernoulli(probs, value):
    d = D.Bernoulli(probs=probs)
    return d.log_prob(value).sum() + d.entropy().sum()


def _beta(a, b, value):
    d = D.Beta(a, b)
    return d.log_prob(value).sum() + d.entropy().sum()


def _multivariate_normal(loc, tril, value):
    d = D.MultivariateNormal(loc, scale_tril=tril)
    return d.log_prob(value).sum() + d.entropy().sum(), d.rsample()


def _transformed(loc, scale, value):
    d = D.TransformedDistribution(D.Normal(loc, scale), [D.transforms.ExpTransform()])
    return d.log_prob(value).sum(), d.rsample((3,))


def _positive(*shape):
    return (torch.rand(*shape) + 0.5).requires_grad_()


def _tril():
    a = torch.randn(3, 3)
    return (torch.linalg.cholesky(a @ a.T + 3 * torch.eye(3))).requires_grad_()


CASES = {
    "normal": (_normal, lambda: (torch.randn(4, requires_grad=True), _positive(4), torch.randn(4))),
    "categorical": (
        _categorical,
        lambda: (torch.randn(4, 5, requires_grad=True), torch.tensor([0, 4, 2, 1])),
    ),
    "bernoulli": (
        _bernoulli,
        lambda: (torch.rand(5).clamp(0.1, 0.9).requires_grad_(), torch.tensor([0.0, 1, 1, 0, 1])),
    ),
    "beta": (_beta, lambda: (_positive(4), _positive(4), torch.rand(4).clamp(0.1, 0.9))),
    "multivariate_normal": (
        _multivariate_normal,
        lambda: (torch.randn(3, requires_grad=True), _tril(), torch.randn(2, 3)),
    ),
    "transformed": (
        _transformed,
        lambda: (torch.randn(4, requires_grad=True), _positive(4), _positive(4).detach()),
    ),
}

# An argument outside the constraint, and what eager says about it.
INVALID = {
    "normal": (1, lambda x: -x.detach()),  # scale > 0
    "categorical": (1, lambda v: v + 7),  # value in the support {0..4}
    "bernoulli": (0, lambda p: p.detach() + 2),  # probs in [0, 1]
    "beta": (2, lambda v: v + 3),  # value in (0, 1)
    "multivariate_normal": (1, lambda t: -t.detach()),  # a lower-Cholesky factor
    "transformed": (2, lambda v: -v),  # value in the support (0, inf)
}


def _grads(out, inputs):
    tensors = [o for o in (out if isinstance(out, tuple) else (out,))]
    total = sum(t.sum() for t in tensors)
    wrt = [x for x in inputs if x.requires_grad]
    return torch.autograd.grad(total, wrt)


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_distribution_values_and_grads_equal_eager(name, tracer):
    fn, make = CASES[name]
    compiled = aotgrad.aot_function(fn, tracer=tracer)
    for seed in (0, 1):
        torch.manual_seed(seed)
        inputs = make()
        torch.manual_seed(100 + seed)
        expected = fn(*inputs)
        torch.manual_seed(100 + seed)
        got = compiled(*inputs)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(_grads(got, inputs), _grads(expected, inputs))


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_invalid_argument_on_a_later_call_raises_like_eager(name, tracer):
    fn, make = CASES[name]
    compiled = aotgrad.aot_function(fn, tracer=tracer)
    torch.manual_seed(0)
    inputs = make()
    compiled(*inputs)
    position, spoil = INVALID[name]
    bad = list(inputs)
    bad[position] = spoil(inputs[position])
    with pytest.raises(ValueError):
        fn(*bad)
    with pytest.raises(RuntimeError, match="a check failed on this call's values") as caught:
        compiled(*bad)
    message = str(caught.value)
    assert "validate_args" in message
    assert "test_distributions.py" in message  # the user's line that made the distribution


def test_an_invalid_argument_on_the_first_call_raises():
    with pytest.raises(RuntimeError, match="a check failed"):
        aotgrad.aot_function(_normal)(torch.zeros(3), -torch.ones(3), torch.zeros(3))


def test_validation_is_in_the_graph():
    traced = aotgrad.trace(_bernoulli, torch.full((3,), 0.5), torch.ones(3))
    assert "torch.ops.aten._assert_async.msg" in traced.forward.code


def test_a_value_read_that_is_not_a_check_stays_refused():
    def branches(x):
        return x * 2 if x.all() else x * 3  # chooses a computation: never assumed

    with pytest.raises(aotgrad.errors.DataDependentError):
        aotgrad.aot_function(branches)(torch.ones(3))


def test_check_tensor_all_is_kept_as_a_check():
    def f(x):
        torch._check_tensor_all(x > 0, lambda: "x must be positive")
        return x.log()

    compiled = aotgrad.aot_function(f)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.zeros(3))
    with pytest.raises(RuntimeError, match="a check failed"):
        compiled(-torch.ones(3))


def _istft(spectrum, window):
    return torch.istft(spectrum, 16, hop_length=4, window=window)


@pytest.mark.parametrize("tracer", [pytest.param("direct", marks=pytest.mark.fast_path), "full"])
def test_istft_round_trip_values_and_grads_equal_eager(tracer):
    signal = torch.randn(2, 64)
    window = torch.hann_window(16).requires_grad_()
    spectrum = torch.stft(signal, 16, hop_length=4, window=window.detach(), return_complex=True)
    spectrum.requires_grad_()
    compiled = aotgrad.aot_function(_istft, tracer=tracer)
    got, expected = compiled(spectrum, window), _istft(spectrum, window)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, signal, atol=1e-5, rtol=1e-5)  # the round trip
    grads = torch.autograd.grad(got.square().sum(), [spectrum, window])
    expected_grads = torch.autograd.grad(expected.square().sum(), [spectrum, window])
    torch.testing.assert_close(grads, expected_grads)
    # A window whose overlap-added square is zero somewhere: eager refuses, and so does the graph.
    zero = torch.zeros(16)
    with pytest.raises(RuntimeError, match="window overlap add min"):
        _istft(spectrum, zero)
    with pytest.raises(RuntimeError, match="istft's window check"):
        compiled(spectrum, zero)


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (
            lambda x, y: torch.nn.functional.multi_margin_loss(x, y),
            "aten.multi_margin_loss_backward.default",
        ),
        (lambda a, y: D.Beta(a, a).rsample().sum() + y.sum(), "aten._sample_dirichlet.default"),
    ],
    ids=["multi_margin_loss_backward", "beta_rsample"],
)
@pytest.mark.fast_path  # without it, PyTorch's fake mode runs the op's kernel on zeros
def test_an_op_without_a_meta_kernel_is_refused_in_its_own_words(fn, op):
    x = (torch.rand(4, 5) + 0.5).requires_grad_()
    y = torch.tensor([1, 0, 3, 2])
    fn(x, y).sum().backward()  # eager runs it
    with pytest.raises(aotgrad.errors.UnsupportedOpError) as caught:
        aotgrad.aot_function(fn)(x, y)
    message = str(caught.value)
    assert f"{op} has no meta kernel or fake implementation" in message
    assert "test_distributions.py" in message  # the user's line, or the function's def
    assert "Eager PyTorch raises the same" not in message
    assert "aotgrad bug" not in message


def test_a_check_on_a_device_tensor_is_asserted_on_the_cpu():
    """A failed assert on a CUDA tensor is a device-side assert, which leaves the CUDA
    context unusable (tests/gpu_checks.py shows it); eager reads the value on the host and
    raises. Traced on meta tensors: the check's bool is copied to the CPU first."""
    for tracer in TRACERS:
        traced = aotgrad.trace(
            _bernoulli,
            torch.full((3,), 0.5, device="meta"),
            torch.ones(3, device="meta"),
            tracer=tracer,
        )
        asserts = [
            n for n in traced.forward.graph.nodes if n.target is torch.ops.aten._assert_async.msg
        ]
        assert asserts
        for node in asserts:
            (flag, _) = node.args
            assert flag.target is torch.ops.aten._to_copy.default
            assert flag.kwargs["device"] == torch.device("cpu")
