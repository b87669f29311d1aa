"""Run every real-model cell and write the model x check table into the README (`make models`).

Runs ``tests/test_real_models.py`` with pytest (all cells, the slow ones included), records each
cell's outcome and replaces the text between ``<!-- models:begin -->`` and
``<!-- models:end -->`` in README.md. Exits with pytest's status, so `make models` fails when a
claimed cell fails or a known failure starts passing (strict xfail).

    python tests/models_table.py [--no-readme] [--jobs N] [pytest args...]

``--jobs N`` splits the models among N pytest processes (one per core) and merges their outcomes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- models:begin -->", "<!-- models:end -->"
CELL = re.compile(r"test_model\[(?P<model>[^\]]+?)-(?P<check>[a-z_]+)\]$")


class Outcomes:
    """A pytest plugin: (model, check) -> "pass" / "not claimed" / "FAIL", plus seconds."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], str] = {}
        self.seconds: dict[tuple[str, str], float] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        match = CELL.search(report.nodeid)
        if match is None or report.when not in ("setup", "call"):
            return
        key = (match["model"], match["check"])
        if report.when == "call":
            self.seconds[key] = report.duration
        if hasattr(report, "wasxfail") and report.skipped:
            self.cells[key] = "not claimed"
        elif report.failed:
            self.cells[key] = "FAIL"
        elif report.passed and report.when == "call":
            self.cells[key] = "pass"


def table(outcomes: Outcomes, elapsed: float) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_real_models import CHECKS, KNOWN_FAILURES, MODELS, NOT_APPLICABLE

    header = "| model | " + " | ".join(CHECKS) + " |"
    lines = [
        f"Measured by `make models` on {platform.machine()}, torch {torch.__version__},"
        f" {datetime.date.today()}, {elapsed / 60:.1f} min.",
        "",
        header,
        "|" + "---|" * (len(CHECKS) + 1),
    ]
    for model in MODELS:
        row = []
        for check in CHECKS:
            key = (model, check)
            row.append("n/a" if key in NOT_APPLICABLE else outcomes.cells.get(key, "not run"))
        lines.append(f"| {model} | " + " | ".join(row) + " |")
    lines += ["", "Checks:"]
    lines += [f"- `{name}`: {text}" for name, text in CHECKS.items()]
    reasons = sorted(set(KNOWN_FAILURES.values()))
    if reasons:
        lines += [
            "",
            "Not claimed yet (known failures, `KNOWN_FAILURES` in `tests/test_real_models.py`):",
        ]
        lines += [f"- {reason}" for reason in reasons]
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = ROOT / "README.md"
    content = readme.read_text()
    start, end = content.index(BEGIN) + len(BEGIN), content.index(END)
    readme.write_text(content[:start] + "\n" + text + "\n" + content[end:])


def run(args: list[str], outcomes: Outcomes) -> int:
    return int(
        pytest.main(
            [
                str(ROOT / "tests" / "test_real_models.py"),
                "-m",
                "models",
                "-p",
                "no:cacheprovider",
                *args,
            ],
            plugins=[outcomes],
        )
    )


def run_split(jobs: int, args: list[str], outcomes: Outcomes) -> int:
    """``jobs`` processes, each running every ``jobs``-th model; their outcomes merged."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_real_models import MODELS

    models = list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for job in range(jobs):
            ids = " or ".join(f"test_model[{m}-" for m in models[job::jobs])
            dump = os.path.join(tmp, f"{job}.json")
            command = [sys.executable, __file__, "--dump", dump, "-k", ids, *args]
            procs.append((subprocess.Popen(command), dump))
        status = 0
        for proc, dump in procs:
            status = max(status, proc.wait())
            with open(dump) as f:
                for model, check, outcome, seconds in json.load(f):
                    outcomes.cells[model, check] = outcome
                    outcomes.seconds[model, check] = seconds
    return status


def main(argv: list[str]) -> int:
    write = "--no-readme" not in argv
    args = [a for a in argv if a != "--no-readme"]
    jobs, dump = 1, None
    if "--jobs" in args:
        i = args.index("--jobs")
        jobs = int(args[i + 1])
        del args[i : i + 2]
    if "--dump" in args:
        i = args.index("--dump")
        dump = args[i + 1]
        del args[i : i + 2]
    outcomes = Outcomes()
    start = time.perf_counter()
    status = run_split(jobs, args, outcomes) if jobs > 1 else run(args, outcomes)
    if dump is not None:
        cells = [(*key, v, outcomes.seconds.get(key, 0.0)) for key, v in outcomes.cells.items()]
        Path(dump).write_text(json.dumps(cells))
        return status
    text = table(outcomes, time.perf_counter() - start)
    print(text)
    if write:
        write_readme(text)
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
