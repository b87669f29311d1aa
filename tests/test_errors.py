"""Clear errors, never a wrong graph: each names the construct, the user's line and a fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import aotgrad
import aotgrad._torch_compat as compat

HERE = __file__


def branch_on_value(x):
    if x.sum() > 0:  # the offending line
        return x * 2
    return x


def item_in_python(x):
    return x * x.max().item()


def data_dependent_shape(x):
    return x[x > 0].sum()


@pytest.mark.parametrize(
    ("fn", "construct", "line"),
    [
        (branch_on_value, "Python control flow", "if x.sum() > 0:"),
        (item_in_python, "`.item()`", "return x * x.max().item()"),
        (data_dependent_shape, "depends on tensor values", "return x[x > 0].sum()"),
    ],
)
def test_data_dependent_python_is_refused_at_the_users_line(fn, construct, line):
    with pytest.raises(aotgrad.DataDependentError) as info:
        aotgrad.trace(fn, torch.randn(3, requires_grad=True))
    message = str(info.value)
    assert construct in message
    assert f"{HERE}:" in message and line in message
    assert "torch.where" in message  # what to do


def test_non_tensor_output_is_refused():
    with pytest.raises(aotgrad.UnsupportedOutputError, match=r"output\[1\] is a builtins.object"):
        aotgrad.trace(lambda x: (x.sin(), object()), torch.randn(3))


def test_wrong_number_of_arguments_says_what_the_function_takes():
    compiled = aotgrad.aot_function(lambda x, w: x @ w)
    with pytest.raises(aotgrad.CallError, match=r"missing a required argument: 'w'"):
        compiled(torch.randn(2, 2))


def test_traced_called_with_another_structure_says_so():
    traced = aotgrad.trace(lambda d: d["a"].sin(), {"a": torch.randn(2)})
    with pytest.raises(
        aotgrad.CallError,
        match=r"argument d is structured otherwise: the capture passed \{'a': float32\[2\]\}",
    ):
        traced({"b": torch.randn(2)})


def test_in_place_on_a_leaf_that_requires_grad_fails_as_in_eager():
    def f(x):
        x.mul_(2)  # the offending line
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as eager:
        f(x.detach().clone().requires_grad_())
    with pytest.raises(
        aotgrad.InPlaceOnLeafError, match="leaf Variable that requires grad"
    ) as ours:
        aotgrad.trace(f, x)
    assert isinstance(ours.value, RuntimeError) and isinstance(eager.value, RuntimeError)
    assert f"{HERE}:" in str(ours.value)
    assert "x.mul_(2)  # the offending line" in str(ours.value), "not the in-place op's line"


def test_errors_are_aotgrad_errors():
    assert issubclass(aotgrad.DataDependentError, aotgrad.AotgradError)
    assert issubclass(aotgrad.CallError, TypeError)


class Holder:
    buffer = torch.zeros(3)  # reached through a class: aotgrad does not walk classes


def test_mutating_a_tensor_aotgrad_cannot_lift_is_refused_before_it_changes():
    def f(x):
        Holder.buffer.add_(x)  # the offending line
        return x * 2

    with pytest.raises(aotgrad.UnsupportedMutationError, match="not an argument") as e:
        aotgrad.trace(f, torch.randn(3))
    assert "Holder.buffer.add_(x)" in str(e.value)
    assert Holder.buffer.eq(0).all(), "the capture wrote the real tensor"


def matmul_of_mismatched_shapes(x, w):
    y = x.sin()
    return y @ w  # the offending matmul


def view_of_transposed(x):
    return x.t().view(-1)  # the offending view


def index_out_of_range(x):
    return x.select(0, 7)  # the offending select


def users_own_error(x):
    raise ValueError("the user's own message")


@pytest.mark.parametrize(
    ("fn", "args", "op", "line", "kind"),
    [
        (
            matmul_of_mismatched_shapes,
            (torch.randn(2, 3, requires_grad=True), torch.randn(4, 5)),
            "aten.mm",
            "return y @ w  # the offending matmul",
            RuntimeError,
        ),
        (
            view_of_transposed,
            (torch.randn(2, 3),),
            "aten.view",
            "return x.t().view(-1)  # the offending view",
            ValueError,
        ),
        pytest.param(
            index_out_of_range,
            (torch.randn(2, 3),),
            "aten.select",
            "return x.select(0, 7)  # the offending select",
            IndexError,
            marks=pytest.mark.skipif(
                compat.TORCH_RELEASE < (2, 13),
                reason="torch 2.11/2.12's fake select does not check the index, so capture cannot"
                " name it: the compiled call raises eager's own IndexError when it runs",
            ),
        ),
    ],
)
def test_error_inside_torch_names_the_op_and_the_users_line(fn, args, op, line, kind):
    with pytest.raises(aotgrad.errors.OpError) as info:
        aotgrad.aot_function(fn)(*args)
    message = str(info.value)
    assert op in message and f"{HERE}:" in message and line in message
    assert isinstance(info.value, kind)  # still the type torch raised
    assert type(info.value.__cause__) is kind  # the original, chained
    with pytest.raises(Exception) as eager:
        fn(*args)  # eager raises it too, as a RuntimeError or the same type
    assert isinstance(info.value, type(eager.value))


def test_users_own_error_passes_unchanged():
    with pytest.raises(ValueError, match="the user's own message") as info:
        aotgrad.aot_function(users_own_error)(torch.randn(2))
    assert not isinstance(info.value, aotgrad.AotgradError)


def test_data_dependent_error_is_not_wrapped_as_an_op_error():
    with pytest.raises(aotgrad.DataDependentError) as info:
        aotgrad.aot_function(item_in_python)(torch.randn(3))
    assert not isinstance(info.value, aotgrad.errors.OpError)


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g[:1]  # the wrong shape


def test_error_in_a_custom_backward_names_autograd_and_chains_the_original():
    with pytest.raises(
        aotgrad.errors.OpError, match=r"backward \(torch\.autograd\.grad\) raised"
    ) as info:
        aotgrad.aot_function(lambda x: BadBackward.apply(x).sum())(
            torch.randn(3, requires_grad=True)
        )
    assert "returned an invalid gradient" in str(info.value.__cause__)


FAKE_TENSOR_LOG_SCRIPT = """
import logging, torch, aotgrad
try:
    aotgrad.aot_function(lambda x: x @ torch.ones(5, 2))(torch.randn(1, 3, requires_grad=True))
except RuntimeError as e:
    print("raised:", e)
assert not logging.getLogger("torch._subclasses.fake_tensor").disabled  # restored after
"""


def test_a_user_error_during_capture_is_not_logged_by_the_fake_tensor_mode():
    result = subprocess.run(
        [sys.executable, "-c", FAKE_TENSOR_LOG_SCRIPT], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "raised: aten.mm.default raised RuntimeError" in result.stdout
    assert "a and b must have same reduction dim" in result.stdout
    assert "failed while attempting to run meta" not in result.stderr


def test_backward_inside_the_function_is_refused_at_its_line():
    w = torch.randn(3, requires_grad=True)

    def step(x):
        loss = (x * w).sum()
        loss.backward()  # the line the error names
        return loss.detach()

    with pytest.raises(aotgrad.errors.UnsupportedOpError, match=r"calls \.backward\(\)") as caught:
        aotgrad.aot_function(step)(torch.randn(3))
    assert "loss.backward()  # the line the error names" in str(caught.value)
    assert w.grad is None


@pytest.mark.parametrize("where", ["argument", "closure", "module"])
def test_reading_grad_inside_the_function_is_refused(where):
    """Note [Reading .grad in a trace]: a clip or an optimizer step would silently see None."""
    lin = torch.nn.Linear(3, 1)
    lin(torch.randn(2, 3)).sum().backward()

    def clip(params):
        torch.nn.utils.clip_grad_norm_(params, 0.01)  # reads .grad of every parameter

    class Clipped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            clip(self.lin.parameters())
            return self.lin(x)

    compiled = {
        "argument": lambda: aotgrad.aot_function(lambda w, x: (clip([w]), x * w)[1])(lin.weight, 1),
        "closure": lambda: aotgrad.aot_function(lambda x: (clip(lin.parameters()), lin(x))[1])(
            torch.randn(2, 3)
        ),
        "module": lambda: aotgrad.aot_module(Clipped())(torch.randn(2, 3)),
    }[where]
    before = lin.weight.grad.clone()
    with pytest.raises(aotgrad.errors.UnsupportedOpError, match=r"reads \.grad") as caught:
        compiled()
    assert "clip_grad_norm_" in str(caught.value) or "clip(" in str(caught.value)
    torch.testing.assert_close(lin.weight.grad, before)


def test_an_internal_assert_in_a_kernel_is_not_blamed_on_the_users_inputs():
    import torch.nn.functional as F

    f = aotgrad.aot_function(
        lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", antialias=True), dynamic=True
    )
    x = torch.randn(1, 1, 4, 4, requires_grad=True)
    F.interpolate(x, scale_factor=2, mode="bicubic", antialias=True).sum().backward()  # eager runs
    with pytest.raises(aotgrad.errors.OpError, match="_upsample_bicubic2d_aa_backward") as caught:
        f(x)
    assert "torch's kernel failing on traced inputs" in str(caught.value)
    assert "Eager PyTorch raises the same" not in str(caught.value)


@torch.library.custom_op("aotgrad_test_errors::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


EAGER_RUNS = {
    "custom op without a fake kernel": (
        lambda x: _no_fake(x) + 1,
        aotgrad.errors.UnsupportedOpError,
    ),
    ".numpy()": (
        lambda x: torch.from_numpy(x.detach().numpy() * 2) + x,
        aotgrad.DataDependentError,
    ),
    "np.asarray": (
        lambda x: torch.as_tensor(__import__("numpy").asarray(x.detach())) + x,
        aotgrad.DataDependentError,
    ),
}


@pytest.mark.parametrize("name", list(EAGER_RUNS))
@pytest.mark.parametrize("requires_grad", [False, True])
def test_no_claim_that_eager_raises_where_eager_runs(name, requires_grad):
    """Note [Checking that eager raises the same]: the claim only where the op's meta kernel
    raises it too, and the failure named for what it is."""
    fn, kind = EAGER_RUNS[name]
    x = torch.randn(3)
    fn(x)  # eager runs
    with pytest.raises(kind) as caught:
        aotgrad.aot_function(fn)(x.requires_grad_(requires_grad))
    message = str(caught.value)
    assert "raises the same" not in message
    assert f"{HERE}:" in message  # the user's line


def test_the_claim_that_eager_raises_the_same_is_made_where_it_does():
    fn = lambda x: x @ torch.ones(4, 4)  # noqa: E731
    x = torch.randn(1, 3)
    with pytest.raises(RuntimeError):
        fn(x)
    with pytest.raises(aotgrad.errors.OpError, match="Eager PyTorch raises the same"):
        aotgrad.aot_function(fn)(x)


def test_data_ptr_of_a_traced_tensor_is_refused_at_the_users_line():
    # The fake tensor's address would be a constant of the graph (eager: the real one's).
    def f(x):
        return x + (x.data_ptr() % 7)

    with pytest.raises(aotgrad.DataDependentError, match=r"data_ptr\(\)[\s\S]*in f: return x \+"):
        aotgrad.aot_function(f)(torch.randn(3))
