"""The differential fuzzer's bounded run: random programs through aotgrad against eager.

Deterministic (the ``fuzz_ci`` profile: ``derandomize=True``); only the features not listed in
``fuzz_programs.KNOWN_BAD`` are generated (see the module docstring for the switch). ``make
fuzz`` runs the long profile over every feature.
"""

from __future__ import annotations

from hypothesis import given, reject, settings

import fuzz_programs as fp


@fp.fuzz_settings()
@given(fp.programs())
def test_random_programs_match_eager(program):
    try:
        fp.check(program)
    except fp.EagerRejected:
        reject()


@settings(parent=fp.fuzz_settings(), max_examples=40)
@given(fp.programs())
def test_random_programs_match_eager_under_create_graph(program):
    # Second-order gradients of the same programs (verify(..., create_graph=True)).
    try:
        fp.check(program, create_graph=True)
    except fp.EagerRejected:
        reject()
