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
from hypothesis import given, reject

import fuzz_programs as fp


@fp.fuzz_settings()
@given(fp.programs())
def test_random_programs_match_eager(program):
    try:
        fp.check(program)
    except fp.EagerRejected:
        reject()


def test_idioms_see_a_parameter_gradient_eager_produces():
    # The oracle itself: a custom Function given a parameter directly (issue 38 item 2).
    # Every idiom over state must compare the parameter's .grad; while aotgrad drops it, the
    # module idiom reports it (the bounded run leaves function_param out: KNOWN_BAD).
    program = fp.Program(
        bases=(fp.Base((3,), True), fp.Base((2,), True)),
        args=("b0", "b1"),
        steps=(fp.Step("MulSum.apply(a1, a0)", "v0"),),
        returns=("v0",),
        modes=("module",),
        state=(0,),
    )
    if "function_param" not in fp.KNOWN_BAD:
        fp.check(program)
        return
    with pytest.raises(fp.FuzzFailure, match=r"grad of model\.p0: None != eager a tensor"):
        fp.check(program)
