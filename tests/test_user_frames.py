"""One rule for "is this the user's code" (Note [User frames]): errors and provenance agree."""

from __future__ import annotations

import os

import pytest
import torch

import aotgrad
from aotgrad.capture import node_info
from aotgrad.errors import OpError, Origin, frame_origin, is_user_file


@pytest.mark.parametrize(
    "filename, origin",
    [
        ("/home/me/model.py", Origin.USER),
        ("<stdin>", Origin.USER),
        ("<console>", Origin.USER),
        (torch.nn.functional.__file__, Origin.LIBRARY),
        (os.__file__, Origin.LIBRARY),
        ("<eval_with_key>.3", Origin.LIBRARY),
        ("<string>", Origin.LIBRARY),
        (aotgrad.__file__, Origin.AOTGRAD),
    ],
)
def test_frame_origin(filename, origin):
    assert frame_origin(filename) is origin
    assert is_user_file(filename) is (origin is Origin.USER)


def _defined_in(filename: str):
    """A function whose code claims to come from ``filename``: ``x @ w`` on line 2."""
    source = "def f(x, w):\n    return (x @ w).sin()\n"
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["f"]


@pytest.mark.parametrize("filename, user", [("<stdin>", True), ("<string>", False)])
def test_provenance_and_errors_apply_the_same_rule(filename, user):
    f = _defined_in(filename)
    traced = aotgrad.trace(f, torch.randn(2, 3), torch.randn(3, 4, requires_grad=True))
    sources = {node_info(n).source for n in traced.forward.graph.nodes if n.op == "call_function"}
    if user:
        assert {(s.filename, s.lineno) for s in sources if s is not None} == {(filename, 2)}
    else:
        assert sources == {None}
    with pytest.raises(OpError) as info:
        aotgrad.trace(f, torch.randn(2, 3), torch.randn(4, 4))
    assert (f"at {filename}:2" in str(info.value)) is user
