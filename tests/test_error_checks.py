"""Ops that check their inputs and raise (linalg's error checks): captured on every path."""

from __future__ import annotations

import pytest
import torch

import aotgrad
from aotgrad.testing import verify


def _mutating(fn):
    """``fn`` behind an in-place op: takes the full (functionalizing) trace."""

    def f(x):
        y = x * 1
        y.add_(1)
        return fn(y)

    return f


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
@pytest.mark.parametrize("path", ["direct", "full", "dynamic"])
def test_linalg_ops_with_error_checks_match_eager(name, path):
    if path == "dynamic" and name in DYNAMIC_SHAPE_GAPS:
        pytest.skip(DYNAMIC_SHAPE_GAPS[name])
    fn = LINALG[name]
    if path == "full":
        fn = _mutating(fn)
    compile_fn = (lambda f: aotgrad.aot_function(f, dynamic=True)) if path == "dynamic" else None
    verify(fn, _spd(), compile_fn=compile_fn)


@pytest.mark.parametrize("path", ["direct", "full"])
def test_error_check_raises_eagers_error_on_bad_input(path):
    fn = torch.linalg.inv if path == "direct" else _mutating(torch.linalg.inv)
    compiled = aotgrad.aot_function(fn)
    compiled(_spd())
    singular = torch.zeros(4, 4) - (1 if path == "full" else 0)  # full: y = x + 1 = 0
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        compiled(singular)
