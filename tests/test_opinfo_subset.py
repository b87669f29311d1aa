"""A deterministic slice of the OpInfo sweep (``make sweep`` runs all of it): no silent mismatch."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "sweep"))
import opinfo_sweep


@pytest.fixture(scope="module")
def outcomes():
    return opinfo_sweep.sweep(every=9, samples=2, runners=["aotgrad"])


def test_subset_has_no_silent_mismatch(outcomes):
    mismatches = [o for o in outcomes if o.status == "mismatch"]
    assert not mismatches, "\n".join(f"{o.op}[{o.sample}]: {o.detail}" for o in mismatches)


def test_subset_mostly_passes(outcomes):
    summary = opinfo_sweep.summarize(outcomes, ["aotgrad"])["aotgrad"]
    assert summary["ops"] >= 50
    assert summary["passing_ops"] >= summary["ops"] - 3, summary["ops_with_errors"]


def test_a_mismatch_is_reported_as_one():
    """The harness itself: a wrong compiled result must come out as a mismatch."""
    import torch

    class Op:
        full_name = name = "fake"

        def __call__(self, x):
            return x.sin()

    class Sample:
        def __init__(self):
            self.input = torch.randn(3, requires_grad=True)
            self.args = ()
            self.kwargs = {}

    opinfo_sweep.RUNNERS["wrong"] = lambda fn: lambda args, kwargs: (args[0] * 0,)
    try:
        (outcome,) = opinfo_sweep.check_sample(Op(), 0, Sample(), ["wrong"])
    finally:
        del opinfo_sweep.RUNNERS["wrong"]
    assert outcome.status == "mismatch"
