"""The differential fuzzer's bounded run: random programs through aotgrad against eager.

Deterministic (the ``fuzz_ci`` profile: ``derandomize=True``); only the features not listed in
``fuzz_programs.KNOWN_BAD`` are generated (see the module docstring for the switch). Each
program runs in every idiom (``fuzz_idioms``): ``aot_function`` over arguments, ``aot_module``
over parameters and buffers, a loss over a global or closed-over module or global tensors,
``trace`` then call on fresh inputs, ``torch.compile`` (a quarter of the programs), and
``create_graph=True`` (a fifth). ``make fuzz`` runs the long profile over every feature.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, reject

import aotgrad
import fuzz_programs as fp


@fp.fuzz_settings()
@given(fp.programs())
def test_random_programs_match_eager(program):
    try:
        fp.check(program)
    except fp.EagerRejected:
        reject()


def _function_over_a_parameter(modes):
    # MulSum.apply(a1, self.p0): a custom Function given a parameter itself (issue 38 item 2).
    return fp.Program(
        bases=(fp.Base((3,), True), fp.Base((2,), True)),
        args=("b0", "b1"),
        steps=(fp.Step("MulSum.apply(a1, a0)", "v0"),),
        returns=("v0",),
        modes=modes,
        state=(0,),
        holder="global_module",
    )


def test_a_parameter_handed_to_a_custom_function_gets_its_gradient_in_every_idiom():
    modes = ("module", "global_module", "trace_module", "trace", "compile")
    assert fp.check(_function_over_a_parameter(modes)).compiled == 1 + len(modes)


def test_the_idioms_compare_a_parameters_gradient(monkeypatch):
    # The oracle itself: an aot_module that loses the parameter's gradient is caught.
    def detached(module):
        state = {n: t.detach() for n, t in module.named_parameters()}
        return lambda *args: torch.func.functional_call(module, state, args)

    monkeypatch.setattr(aotgrad, "aot_module", detached)
    with pytest.raises(fp.FuzzFailure, match=r"grad of model\.p0: None != eager a tensor"):
        fp.check(_function_over_a_parameter(("module",)))


def _two_tensor_program(steps, returns, touch=False):
    return fp.Program(
        bases=(fp.Base((2, 3), True, two=True), fp.Base((3,), False)),
        args=("b0", "b1"),
        steps=steps,
        returns=returns,
        modes=("function", "trace"),
        touch_outputs=touch,
    )


def test_two_tensor_arguments_run_in_the_function_and_trace_idioms():
    program = _two_tensor_program((fp.Step("a0.sin() * a1", "v0"),), ("v0",), touch=True)
    assert "TwoTensor(torch.randn(2, 3), torch.randn(2, 3)).requires_grad_()" in repr(program)
    assert fp.check(program).compiled == 2  # "aot" (verify) is left out: it cannot copy them


def test_touching_the_outputs_catches_an_output_that_is_no_view(monkeypatch):
    # An output of unbind changed in place after the call: eager raises, and so does aotgrad
    # (Note [Multi-output views]); with the view rule dropped, the touch check sees it.
    program = fp.Program(
        bases=(fp.Base((3, 2), True),),
        args=("b0",),
        steps=(fp.Step("a0 * 1", "v0"), fp.Step("v0.unbind(0)[0]", "v1")),
        returns=("v1",),
        modes=("function",),
        touch_outputs=True,
    )
    fp.check(program)
    import aotgrad.runtime.function as runtime_function

    monkeypatch.setattr(runtime_function, "set_view_creation", lambda view, name: None)
    with pytest.raises(fp.FuzzFailure, match=r"mul_\(1\) after the call: ran != eager"):
        fp.check(program)


def _dtensor_program(placement, steps, returns):
    return fp.Program(
        bases=(
            fp.Base((2, 3), True, placement=placement),
            fp.Base((3,), False, placement="Replicate()"),
        ),
        args=("b0", "b1"),
        steps=steps,
        returns=returns,
        modes=("function", "trace"),
    )


@pytest.mark.parametrize("placement", ["Replicate()", "Shard(0)"])
def test_dtensor_arguments_run_in_the_function_and_trace_idioms(placement):
    program = _dtensor_program(placement, (fp.Step("a0.sin() * a1", "v0"),), ("v0",))
    source = f"distribute_tensor(torch.randn(2, 3), one_rank_mesh(), [{placement}])"
    assert f"{source}.requires_grad_()" in repr(program)
    assert fp.check(program).compiled == 2  # "aot" (verify) is left out: it cannot copy them


def test_the_idioms_compare_a_dtensor_gradients_placements(monkeypatch):
    # The oracle itself: a gradient of the right values but another placement is caught.
    from torch.distributed.tensor import Replicate

    program = _dtensor_program("Shard(0)", (fp.Step("a0 * a1", "v0"),), ("v0",))
    real = aotgrad.aot_function

    def replicated_grads(fn, **kwargs):
        compiled = real(fn, **kwargs)

        def call(*args):
            for a in args:
                if a.requires_grad:
                    a.register_hook(lambda g: g.redistribute(placements=[Replicate()]))
            return compiled(*args)

        return call

    monkeypatch.setattr(aotgrad, "aot_function", replicated_grads)
    with pytest.raises(fp.FuzzFailure, match=r"grad of .*placements \(Replicate\(\),\) != eager"):
        fp.check(program)
