"""Ops that check their inputs and raise (linalg's error checks): captured on every path."""

from __future__ import annotations

import functools

import pytest
import torch

import aotgrad
from aotgrad.testing import verify

LINALG = {
    "inv": torch.linalg.inv,
    "cholesky": torch.linalg.cholesky,
    "solve": lambda x: torch.linalg.solve(x, x.sum(1)),
    "det": torch.linalg.det,
    "eig": lambda x: torch.linalg.eig(x)[0].abs(),
    "eigvals": lambda x: torch.linalg.eigvals(x).abs(),
    "lu_factor": lambda x: torch.linalg.lu_factor(x)[0],
    "tensorinv": lambda x: torch.linalg.tensorinv(x.reshape(4, 2, 2), ind=1),
}

# Failures with dynamic=True that are not about error checks (dynamic shapes' own gaps).
DYNAMIC_SHAPE_GAPS = {
    "cholesky": "linalg_solve_triangular's meta kernel needs concrete sizes",
    "lu_factor": "linalg_solve_triangular's meta kernel needs concrete sizes",
    "tensorinv": "returns a view of a symbolic layout (UnsupportedOutputError)",
}


def _spd():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    return (a @ a.t() + 4 * torch.eye(4)).requires_grad_()


@pytest.mark.parametrize("name", sorted(LINALG))
@pytest.mark.parametrize(
    "path", [pytest.param("direct", marks=pytest.mark.fast_path), "full", "dynamic"]
)
def test_linalg_ops_with_error_checks_match_eager(name, path):
    if path == "dynamic" and name in DYNAMIC_SHAPE_GAPS:
        pytest.skip(DYNAMIC_SHAPE_GAPS[name])
    options = {
        "dynamic": {"dynamic": True},
        "full": {"tracer": "full"},
        "direct": {"tracer": "direct"},
    }
    compile_fn = functools.partial(aotgrad.aot_function, **options[path])
    verify(LINALG[name], _spd(), compile_fn=compile_fn)


@pytest.mark.parametrize("path", [pytest.param("direct", marks=pytest.mark.fast_path), "full"])
def test_error_check_raises_eagers_error_on_bad_input(path):
    compiled = aotgrad.aot_function(torch.linalg.inv, tracer=path)
    compiled(_spd())
    assert compiled.partitioned is not None
    assert compiled.partitioned.joint.tracer.name == path
    singular = torch.zeros(4, 4)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        compiled(singular)
