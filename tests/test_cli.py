"""``aotgrad show`` prints both graphs, descriptors, saved values and an eager check."""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import subprocess
import sys

import pytest

import aotgrad
from aotgrad.cli import main
from aotgrad.report import show_document

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
        "match: 3 outputs, 4 gradients, 4 inputs and 0 reached tensors compared",
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


@pytest.mark.fast_path
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


@pytest.mark.fast_path
def test_show_with_the_direct_tracer_refuses_what_it_cannot_trace(tmp_path, capsys):
    (tmp_path / "cases.py").write_text(CASES)
    assert main(["show", f"{tmp_path / 'cases.py'}:mutates", "--tracer", "direct"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "aotgrad: DirectTraceError: tracer='direct' cannot capture this function:"
        " aten.t_.default mutates an input's size or strides"
    )
    assert "x.t_()  # the direct trace stops here" in err


# Note [Importing the user's file]: the file runs as a script would, under a private name.

SCRIPT_BODY = """
import torch


def fn(x):
    return x.sin()


def example_inputs():
    return (torch.ones(2, 3),), {}
"""


@pytest.mark.parametrize("stem", ["copy", "typing", "json", "aotgrad", "torch"])
def test_show_imports_a_file_named_like_a_library_under_a_private_name(tmp_path, capsys, stem):
    import copy
    import typing

    before = {name: sys.modules.get(name) for name in ("copy", "typing", "json", stem)}
    target = tmp_path / f"{stem}.py"
    target.write_text(SCRIPT_BODY)
    assert main(["show", f"{target}:fn"]) == 0, capsys.readouterr().err
    assert "match: 1 outputs" in capsys.readouterr().out
    after = {name: sys.modules.get(name) for name in before}
    assert after == before
    assert sys.modules["copy"] is copy and sys.modules["typing"] is typing
    assert sys.path.index(str(tmp_path)) > 0  # appended, never first


def test_show_runs_a_file_whose_sibling_modules_import(tmp_path, capsys):
    (tmp_path / "helpers_for_show.py").write_text("SCALE = 3.0\n")
    (tmp_path / "main_file.py").write_text(
        "from helpers_for_show import SCALE\n" + SCRIPT_BODY.replace("x.sin()", "x.sin() * SCALE")
    )
    assert main(["show", f"{tmp_path / 'main_file.py'}:fn", "--no-check"]) == 0


@pytest.mark.parametrize(
    ("top_level", "message"),
    [
        ("import sys\nsys.exit(0)\n", "called sys.exit(0) at "),
        ("import sys\nsys.exit()\n", "called sys.exit(None (0)) at "),
        ("raise SystemExit('bye')\n", "called sys.exit('bye') at "),
        (
            "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\n"
            "p.parse_args()\n",
            "called sys.exit(2) at ",
        ),
    ],
    ids=["exit-0", "exit-none", "exit-text", "argparse-required"],
)
def test_show_reports_a_file_that_exits_at_import(tmp_path, capsys, top_level, message):
    target = tmp_path / "script.py"
    target.write_text(SCRIPT_BODY + top_level)
    assert main(["show", f"{target}:fn", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"importing {target} {message}{target}:" in captured.err
    assert 'if __name__ == "__main__":' in captured.err
    assert "Traceback" not in captured.err
    assert "_aotgrad_show_script" not in sys.modules


def test_show_gives_the_file_the_argv_of_a_script(tmp_path, capsys):
    target = tmp_path / "script.py"
    target.write_text(
        SCRIPT_BODY
        + "import argparse, sys\nSEEN = list(sys.argv)\n"
        + "OPTIONS = argparse.ArgumentParser().parse_args()\n"
        + "if __name__ == '__main__':\n    raise SystemExit(5)\n"
    )
    assert main(["show", f"{target}:fn", "--no-check", "--tracer", "full"]) == 0
    assert [str(target)] == sys.modules["_aotgrad_show_script"].SEEN
    assert sys.argv[0] != str(target)  # restored after the run


def test_show_reports_a_function_that_exits(tmp_path, capsys):
    target = tmp_path / "script.py"
    target.write_text(SCRIPT_BODY + "\ndef quits(x):\n    raise SystemExit(3)\n")
    assert main(["show", f"{target}:quits"]) == 1
    err = capsys.readouterr().err
    assert "quits raised SystemExit: 3 at " in err


def test_show_into_a_closed_pipe_exits_quietly():
    # Note [A closed stdout]: `aotgrad show ... --json | head -1`, with the reader gone
    # before the first write (a pipe buffer would otherwise take the whole document).
    result = _show_into_a_closed_pipe(f"{EXAMPLE}:fn", "--json")
    assert result.stderr == ""
    assert result.returncode == 141


def _show_into_a_closed_pipe(*argv: str) -> subprocess.CompletedProcess[str]:
    """``aotgrad show ARGV`` in a fresh process whose stdout is a pipe nobody reads."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "aotgrad.cli", "show", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("flag", [[], ["--json"]])
def test_show_into_a_full_disk_names_stdout_not_the_function(flag):
    # Note [A closed stdout]: aotgrad's own write failing is not the user's function raising.
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "aotgrad.cli", "show", f"{EXAMPLE}:fn", "--no-check", *flag],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    assert result.returncode == 1
    assert result.stderr.startswith("aotgrad: cannot write stdout: [Errno 28]"), result.stderr
    assert "raised" not in result.stderr


def test_show_html_into_a_missing_folder_names_the_file(tmp_path, capsys):
    out = tmp_path / "missing" / "report.html"
    assert main(["show", f"{EXAMPLE}:fn", "--html", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"aotgrad: cannot write {out}: [Errno 2]") and "raised" not in err


def test_an_oserror_the_function_raises_is_still_the_functions(tmp_path, capsys):
    script = tmp_path / "opens.py"
    script.write_text(
        "import torch\n"
        "def fn(x):\n"
        "    open('/nonexistent/data.txt')\n"
        "    return x.sin()\n"
        "def example_inputs():\n"
        "    return (torch.ones(2, requires_grad=True),), {}\n"
    )
    assert main(["show", f"{script}:fn"]) == 1
    err = capsys.readouterr().err
    assert f"{script}:fn raised FileNotFoundError" in err and "opens.py:3" in err


def test_a_function_printing_into_a_closed_pipe_exits_quietly(tmp_path):
    # Note [A closed stdout]: `aotgrad show chatty.py:fn | head -1` with a function that prints
    # more than a pipe holds: its print meets the closed pipe, the reader's choice.
    script = tmp_path / "chatty.py"
    script.write_text(
        "import torch\n"
        "def fn(x):\n"
        "    for i in range(20000):\n"
        "        print('step', i)\n"
        "    return x.sin()\n"
        "def example_inputs():\n"
        "    return (torch.ones(2, requires_grad=True),), {}\n"
    )
    result = _show_into_a_closed_pipe(f"{script}:fn")
    assert result.stderr == ""
    assert result.returncode == 141


def test_a_broken_pipe_of_the_functions_own_is_its_error(tmp_path, capsys):
    script = tmp_path / "piped.py"
    script.write_text(
        "import os, torch\n"
        "def fn(x):\n"
        "    r, w = os.pipe()\n"
        "    os.close(r)\n"
        "    os.write(w, b'data')\n"
        "    return x.sin()\n"
        "def example_inputs():\n"
        "    return (torch.ones(2, requires_grad=True),), {}\n"
    )
    assert main(["show", f"{script}:fn"]) == 1
    assert f"{script}:fn raised BrokenPipeError" in capsys.readouterr().err


OPTIONS = """
import torch

aten = torch.ops.aten


def f(x, w, w2):
    return torch.nn.functional.silu(x @ w).sin().mm(w2).sum()


def save_matmuls(node):
    return node.target is aten.mm.default


SILU = {aten.silu.default: lambda x: x * torch.sigmoid(x)}
NUMBER = 3
NOT_OPS = {"silu": lambda x: x}


def example_inputs():
    return tuple(torch.randn(4, 4, requires_grad=True) for _ in range(3)), {}


def g(x, w1, w2):  # budget()'s docstring: a peak budget recomputes the first relu
    h = (x @ w1).relu() @ w2
    return ((h @ w1).relu() @ w2).sum()


def g_inputs():
    w1, w2 = torch.randn(16, 256, requires_grad=True), torch.randn(256, 16, requires_grad=True)
    return (torch.randn(64, 16), w1, w2), {}
"""


def _options_file(tmp_path):
    path = tmp_path / "options.py"
    path.write_text(OPTIONS)
    return path, runpy.run_path(str(path))


@pytest.mark.parametrize(
    ("flags", "keywords"),
    [
        (["--partition", "mincut"], lambda ns: dict(partition="mincut")),
        (["--partition", "budget(0.1)"], lambda ns: dict(partition=aotgrad.budget(0.1))),
        (["--partition", "budget(300)"], lambda ns: dict(partition=aotgrad.budget(300))),
        (
            ["--partition", "budget(peak=250_000)", "--inputs", "g_inputs"],
            lambda ns: dict(partition=aotgrad.budget(peak=250_000)),
        ),
        (["--partition", "save_matmuls"], lambda ns: dict(partition=ns["save_matmuls"])),
        (["--decompositions", "core_aten"], lambda ns: dict(decompositions="core_aten")),
        (["--decompositions", "SILU"], lambda ns: dict(decompositions=ns["SILU"])),
        (
            ["--partition", "mincut", "--decompositions", "core_aten"],
            lambda ns: dict(partition="mincut", decompositions="core_aten"),
        ),
    ],
    ids=["mincut", "budget", "budget-bytes", "budget-peak", "policy", "core-aten", "dict", "both"],
)
def test_show_takes_partition_and_decompositions_as_trace_does(tmp_path, capsys, flags, keywords):
    """`--partition` / `--decompositions` give the graphs `trace` gives for the same values, and
    the eager check runs those graphs."""
    path, namespace = _options_file(tmp_path)
    name, inputs = ("g", "g_inputs") if "g_inputs" in flags else ("f", "example_inputs")
    assert main(["show", f"{path}:{name}", "--json", *flags]) == 0
    shown = json.loads(capsys.readouterr().out)
    args, kwargs = namespace[inputs]()
    traced = aotgrad.trace(namespace[name], *args, **keywords(namespace), **kwargs)
    default = aotgrad.trace(namespace[name], *args, **kwargs)
    assert shown == json.loads(json.dumps(show_document(traced.partitioned)))
    assert shown != json.loads(json.dumps(show_document(default.partitioned)))  # they act
    assert main(["show", f"{path}:{name}", *flags]) == 0
    assert "match: 1 outputs," in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--partition", "nope"], "--partition 'nope' is not a partition strategy: pass save_all,"),
        (["--partition", "NUMBER"], "(the file's NUMBER is of type int)"),
        (["--partition", "budget(-1)"], "--partition 'budget(-1)': a budget must be positive"),
        (["--partition", "budget(x)"], "a budget's arguments must be numbers"),
        (["--partition", "budget(__import__('os'))"], "a budget's arguments must be numbers"),
        (["--partition", "budget("], "--partition 'budget(': '(' was never closed"),
        (["--partition", "budget(peak=0.5)"], "takes a whole number of bytes, got 0.5"),
        (["--partition", "budget(0.1, peak=3)"], "takes exactly one of a saved-bytes limit"),
        (["--decompositions", "nope"], "--decompositions 'nope' is not a decomposition set"),
        (
            ["--decompositions", "NOT_OPS"],
            "must map each OpOverload (aten.silu.default, not aten.silu) to a function",
        ),
    ],
)
def test_show_refuses_a_partition_or_decompositions_it_cannot_take(tmp_path, capfd, flags, message):
    path, _ = _options_file(tmp_path)
    assert main(["show", f"{path}:f", *flags]) == 2
    err = capfd.readouterr().err
    assert message in err and err.startswith("aotgrad: --"), err
    assert len(err.strip().splitlines()) == 1, err
