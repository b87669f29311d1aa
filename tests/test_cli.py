"""``aotgrad show`` prints both graphs, descriptors, saved values and an eager check."""

from __future__ import annotations

import pathlib
import subprocess
import sys

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
