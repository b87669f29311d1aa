"""``aotgrad show`` prints both graphs, descriptors, saved values and an eager check."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from aotgrad.cli import main

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "carry.py"


def test_show_prints_graphs_descriptors_saved_and_check(capsys):
    assert main(["show", f"{EXAMPLE}:fn"]) == 0
    out = capsys.readouterr().out
    for expected in [
        "=== forward graph ===",
        "=== backward graph ===",
        "carry_a,  # carry['a']",
        "# grad of x['biases']",
        "# cotangent of output[1]",
        "total: 156 B in 6 storage(s) (72 B beyond the inputs)",
        "SeqNr|OrigAten|SrcFn",
        "7|aten.sigmoid_backward.default|fn",
        "match: 3 outputs and 4 gradients compared",
    ]:
        assert expected in out


def test_bad_target_is_a_clear_error(capsys):
    assert main(["show", f"{EXAMPLE}:nope"]) == 2
    assert "defines no 'nope'" in capsys.readouterr().err


def test_console_script_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "aotgrad.cli", "show", f"{EXAMPLE}:fn", "--no-check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "=== backward graph ===" in result.stdout


CASES = """
import torch

NOT_A_FUNCTION = 3


def fn(x):
    return x.sin()


def shape_error(x):
    return x @ torch.ones(5, 2)  # the offending line


def raises():
    raise ValueError("boom")


def wrong_shape():
    return [torch.ones(2)]


def mutates(x):
    x.t_()  # the direct trace stops here
    return x.sin()


def example_inputs():
    return (torch.ones(2, 3),), {}
"""


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["bad.py:fn"], 2, "bad.py:3: syntax error"),
        (["cases.py:NOT_A_FUNCTION"], 2, "NOT_A_FUNCTION is of type int, not a function"),
        (["cases.py:fn", "--inputs", "raises"], 2, "raises() raised ValueError: boom"),
        (["cases.py:fn", "--inputs", "wrong_shape"], 2, "must return (args, kwargs)"),
        (["cases.py:fn", "--inputs", "fn"], 2, "fn() raised TypeError"),
        (["cases.py:shape_error"], 1, "x @ torch.ones(5, 2)  # the offending line"),
    ],
    ids=[
        "syntax-error",
        "not-a-function",
        "inputs-raise",
        "inputs-wrong-shape",
        "inputs-args",
        "function-raises",
    ],
)
def test_show_reports_bad_targets_in_one_line(tmp_path, capfd, argv, code, message):
    (tmp_path / "cases.py").write_text(CASES)
    (tmp_path / "bad.py").write_text("import torch\n\ndef fn(x)\n    return x\n")
    target, *rest = argv
    assert main(["show", str(tmp_path / target), *rest]) == code
    err = capfd.readouterr().err
    assert message in err
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    # A load error is one line; a capture error is aotgrad's own: what, where, what to do.
    assert len(lines) == 1 or (code == 1 and lines[0].startswith("aotgrad: ")), err


def test_show_says_which_tracer_made_the_graphs_and_why(tmp_path, capsys):
    (tmp_path / "cases.py").write_text(CASES)
    cases = str(tmp_path / "cases.py")
    assert main(["show", f"{cases}:fn", "--no-check"]) == 0
    assert "=== tracer ===\ndirect\n" in capsys.readouterr().out
    assert main(["show", f"{cases}:mutates", "--no-check"]) == 0
    line = CASES.splitlines().index("    x.t_()  # the direct trace stops here") + 1
    assert (
        f"=== tracer ===\nfull (the direct trace stopped at {cases}:{line}:"
        " aten.t_.default mutates an input's size or strides)\n"
    ) in capsys.readouterr().out
    assert main(["show", f"{cases}:fn", "--no-check", "--tracer", "full"]) == 0
    assert "=== tracer ===\nfull (tracer='full' was asked)\n" in capsys.readouterr().out


def test_show_with_the_direct_tracer_refuses_what_it_cannot_trace(tmp_path, capsys):
    (tmp_path / "cases.py").write_text(CASES)
    assert main(["show", f"{tmp_path / 'cases.py'}:mutates", "--tracer", "direct"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "aotgrad: DirectTraceError: tracer='direct' cannot capture this function:"
        " aten.t_.default mutates an input's size or strides"
    )
    assert "x.t_()  # the direct trace stops here" in err
