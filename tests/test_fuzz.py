"""The differential fuzzer's bounded run: random programs through aotgrad against eager.

Deterministic (the ``fuzz_ci`` profile: ``derandomize=True``); only the features not listed in
``fuzz_programs.KNOWN_BAD`` are generated (see the module docstring for the switch). ``make
fuzz`` runs the long profile over every feature.
"""

from __future__ import annotations

from hypothesis import given, reject

import fuzz_programs as fp


@fp.fuzz_settings()
@given(fp.programs())
def test_random_programs_match_eager(program):
    try:
        fp.check(program)
    except fp.EagerRejected:
        reject()
