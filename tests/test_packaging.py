"""What a user's ``pip install`` meets: ranges that leave an in-range torch alone, an sdist
that carries its tests and docs, the license as an SPDX expression."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP_DRY_RUN = (sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet")
PIP_DRY_RUN += ("--no-build-isolation",)


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_installing_beside_the_running_torch_changes_nothing_else():
    """``pip install .`` into this environment (whatever torch of the window it holds) would
    install aotgrad alone: no torch, numpy, scipy or networkx replaced."""
    pytest.importorskip("setuptools", minversion="77")
    report = ROOT / "build" / "pip-report.json"
    report.parent.mkdir(exist_ok=True)
    subprocess.run(
        [*PIP_DRY_RUN, "--report", str(report), str(ROOT)],
        check=True,
        capture_output=True,
        # aotgrad's own ranges only: not a machine-wide pip cap on torch releases (this
        # development machine caps torch at 2.14.1, which a 2.15 environment would fail).
        env={**os.environ, "PIP_CONSTRAINT": "/dev/null"},
    )
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["aotgrad"]


def test_ranges_not_pins():
    project = _project()
    assert project["license"] == "BSD-3-Clause"
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    pinned = [
        r for r in project["dependencies"] + project["optional-dependencies"]["dev"] if "==" in r
    ]
    assert pinned == [], "exact versions belong in constraints.txt"
    assert any(r.startswith("torch>=2.11,<2.16") for r in project["dependencies"])


def test_sdist_carries_tests_docs_and_examples(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta as b; b.build_sdist({str(tmp_path)!r})",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (sdist,) = tmp_path.glob("aotgrad-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in (
        "LICENSE",
        "conftest.py",
        "constraints.txt",
        "docs/caching.md",
        "examples/carry.py",
    ):
        assert needed in names, needed
    assert "tests/conftest.py" in names and "tests/library_models.py" in names
    assert not any("__pycache__" in name for name in names)
