"""``import aotgrad`` loads no heavy dependency: each loads with the feature that needs it.

Issue 29: Dynamo (and with it sympy, FSDP and Inductor's utilities), SciPy, numpy, networkx
and ``torch.distributed``'s FSDP and DTensor are not imported by a plain ``import aotgrad``;
the budget solver imports SciPy, the first min-cut networkx, and a capture, through
PyTorch's fake tensors, Dynamo and what Dynamo imports (numpy, sympy: Note [What loads
Dynamo]). Each check runs in a fresh
interpreter, so what this test process imported does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch.fx.experimental.symbolic_shapes",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.onnx",
    "sympy",
    "mpmath",
    "scipy",
    "numpy",
    "networkx",
)


def _loaded_after(code: str) -> set[str]:
    """The HEAVY modules a fresh interpreter holds after ``import torch`` then ``code``
    that ``import torch`` alone did not load."""
    script = textwrap.dedent(
        f"""
        import json, sys
        import torch
        before = set(sys.modules)
        {code}
        print(json.dumps(sorted(set(sys.modules) - before)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    new = json.loads(out.splitlines()[-1])
    return {h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in new)}


def test_import_aotgrad_loads_no_heavy_dependency() -> None:
    assert _loaded_after("import aotgrad") == set()


def test_every_public_name_resolves_without_heavy_imports() -> None:
    code = "import aotgrad\n        [getattr(aotgrad, n) for n in aotgrad.__all__]"
    assert _loaded_after(code) == set()


def test_the_cli_module_loads_no_heavy_dependency() -> None:
    assert _loaded_after("import aotgrad.cli") == set()


@pytest.mark.parametrize(
    ("partition", "expected", "absent"),
    [
        ("'save_all'", set(), {"scipy", "networkx"}),
        ("'mincut'", {"networkx"}, {"scipy"}),
        ("aotgrad.budget(0.5)", {"scipy"}, set()),
        ("aotgrad.budget(peak=10**9)", {"scipy", "networkx"}, set()),
    ],
)
def test_each_solver_loads_with_its_partition(
    partition: str, expected: set[str], absent: set[str]
) -> None:
    code = f"""import aotgrad
        f = aotgrad.aot_function(lambda x: x.sin().cos().sum(), partition={partition})
        f(torch.ones(3, requires_grad=True)).backward()"""
    loaded = _loaded_after(code)
    assert expected <= loaded
    assert not absent & loaded
