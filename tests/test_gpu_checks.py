"""``tests/gpu_checks.py`` (``make gpu-check``) on a machine without CUDA: it says so and exits 0,
its CPU switch runs a check and prints the table, and one check failing never stops the next."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpu_checks

SCRIPT = Path(__file__).resolve().parent / "gpu_checks.py"


def _script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "AOTGRAD_GPU_CHECK_DEVICE"}
    environ |= {"CUDA_VISIBLE_DEVICES": "", **env}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_cuda_it_says_so_and_exits_0() -> None:
    done = _script()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu-check skipped: no CUDA device here" in done.stdout


def test_the_cpu_switch_runs_a_check_and_prints_the_table() -> None:
    done = _script("--only", "rng: dropout_masks_are_eagers", AOTGRAD_GPU_CHECK_DEVICE="cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split("|")[0].strip() == "check", done.stdout
    row = next(line for line in lines if line.startswith("rng: dropout_masks_are_eagers"))
    assert row.split("|")[1].strip() == "ok", done.stdout


def test_a_failing_check_is_a_row_and_the_exit_status(monkeypatch: pytest.MonkeyPatch) -> None:
    def mismatch() -> None:
        raise AssertionError("output differs")

    def crash() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def missing() -> None:
        raise gpu_checks.Skip("timm is not installed")

    checks = [
        gpu_checks.Check("mismatch", mismatch),
        gpu_checks.Check("crash", crash),
        gpu_checks.Check("missing", missing),
        gpu_checks.Check("fine", lambda: "1.0 MB"),
        gpu_checks.Check("cuda", lambda: None, cuda_only=True),
    ]
    monkeypatch.setattr(gpu_checks, "ON_CUDA", False)
    rows = gpu_checks.run_all(checks)
    assert [(r.check, r.result) for r in rows] == [
        ("mismatch", "FAILED"),
        ("crash", "FAILED"),
        ("missing", "skipped"),
        ("fine", "ok"),
        ("cuda", "skipped"),
    ]
    assert "output differs" in rows[0].detail and rows[3].detail.startswith("1.0 MB")
    assert gpu_checks.exit_status(rows) == 1
    assert gpu_checks.exit_status(rows[2:]) == 0
    table = gpu_checks.table(rows).splitlines()
    assert len(table) == 2 + len(rows) and all(line.count(" | ") >= 2 for line in table[2:])


def test_a_missing_library_skips_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_checks, "DEVICE", "cpu")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails: not installed
    row = gpu_checks.run_check(
        gpu_checks.Check("gpt2-aot_module", gpu_checks._model_cell("gpt2", "aot_module"))
    )
    assert (row.result, row.detail) == ("skipped", "transformers is not installed")


def test_a_mismatch_in_a_known_failure_is_still_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """KNOWN_FAILURES are loud refusals: a cell listed there that compares wrong is FAILED."""
    import test_real_models as real

    def wrong(model: str, check: str, make: object) -> None:
        raise AssertionError("grad of lm_head.weight: 3/64 differ")

    monkeypatch.setattr(real, "run_check", wrong)
    row = gpu_checks.run_check(
        gpu_checks.Check("x", gpu_checks._model_cell("mixtral_eager", "aot_module"))
    )
    assert row.result == "FAILED", row


def test_a_model_its_library_cannot_build_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another version of the library (the GPU machine's own) may refuse a config argument:
    aotgrad never ran, so the cell is skipped with the error, not failed."""
    import library_models

    def old_transformers(dropout: float = 0.0) -> None:
        raise TypeError("MixtralConfig.__init__() got an unexpected keyword argument")

    monkeypatch.setattr(gpu_checks, "DEVICE", "cpu")
    monkeypatch.setitem(library_models.BUILDERS, "mixtral", old_transformers)
    row = gpu_checks.run_check(
        gpu_checks.Check("mixtral-aot_module", gpu_checks._model_cell("mixtral", "aot_module"))
    )
    assert row.result == "skipped" and "mixtral cannot be built here" in row.detail, row
    assert "unexpected keyword argument" in row.detail, row


def test_an_import_failing_in_a_library_skips_and_elsewhere_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import test_real_models as real

    def old_timm(model: str, check: str, make: object) -> None:
        raise ImportError("cannot import name 'set_reentrant_ckpt'", name="timm.layers")

    def broken_compat(model: str, check: str, make: object) -> None:
        raise ImportError("cannot import name 'FakeTensorMode'", name="torch._subclasses")

    cell = gpu_checks.Check("vit-ckpt_reentrant", gpu_checks._model_cell("vit", "ckpt_reentrant"))
    monkeypatch.setattr(real, "run_check", old_timm)
    assert gpu_checks.run_check(cell).result == "skipped"
    monkeypatch.setattr(real, "run_check", broken_compat)
    assert gpu_checks.run_check(cell).result == "FAILED"


def test_a_check_past_its_limit_fails_and_the_run_keeps_its_budget() -> None:
    def hangs() -> None:
        time.sleep(30)

    checks = [gpu_checks.Check("hangs", hangs, limit_s=1), gpu_checks.Check("later", lambda: None)]
    rows = gpu_checks.run_all(checks, total_s=0.5)
    assert [(r.result, r.detail) for r in rows] == [
        ("FAILED", "still running after 1 s"),
        ("not run", "the run's 0 s were spent"),
    ]
