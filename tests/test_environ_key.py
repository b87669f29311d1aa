"""Environment variables read at capture are keyed (Note [Environment read at capture]).

A function that branches on ``os.environ`` bakes the branch into its graph: a
call, or another process, under another value must trace again, never reuse it.
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

import aotgrad
from aotgrad.errors import CallError, StoreError

ROOT = pathlib.Path(__file__).resolve().parents[1]
X = torch.tensor([-1.0, 0.5])


def _act(x):
    if os.environ.get("ACT") == "gelu":
        return F.gelu(x)
    return torch.relu(x)


def _getitem(name):
    try:
        return os.environ[name]
    except KeyError:
        return None


def _python(script, cache_dir, extra_env, timeout=120):
    """Run ``script`` from a file (the disk cache keys code by its file) in a new process."""
    path = cache_dir.parent / "script.py"
    if not path.exists():  # written once: the disk key holds the file's modification time
        path.write_text(textwrap.dedent(script))
    env = {**os.environ, "AOTGRAD_CACHE": "1", "AOTGRAD_CACHE_DIR": str(cache_dir), **extra_env}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
    done = subprocess.run(
        [sys.executable, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


TWO_FUNCTIONS = """
    import os, torch, aotgrad
    def f(x):
        if os.environ.get("ACT") == "gelu":
            return torch.nn.functional.gelu(x)
        return torch.relu(x)
    def g(x):
        return x * 3
    x = torch.tensor([-1.0, 0.5])
    for fn in (f, g):
        c = aotgrad.aot_function(fn)
        info = aotgrad.cache_info(c)
        print(torch.equal(c(x), fn(x)), info.disk_hits, info.disk_skipped)
"""


def test_a_second_process_under_another_value_does_not_get_the_first_graph(cache_dir):
    first = _python(TWO_FUNCTIONS, cache_dir, {"ACT": "relu"})
    assert first == [
        "True 0 the function read environment variables ACT at capture",
        "True 0 None",
    ]
    second = _python(TWO_FUNCTIONS, cache_dir, {"ACT": "gelu"})
    # f read ACT: never served from disk; g read nothing: a disk hit as before.
    assert second == [
        "True 0 the function read environment variables ACT at capture",
        "True 1 None",
    ]


def test_a_change_in_process_traces_again_and_says_why(monkeypatch):
    monkeypatch.setenv("ACT", "relu")
    c = aotgrad.aot_function(_act)
    torch.testing.assert_close(c(X), torch.relu(X))
    torch.testing.assert_close(c(X), torch.relu(X))  # a hit: the last entry is not kept
    monkeypatch.setenv("ACT", "gelu")
    torch.testing.assert_close(c(X), F.gelu(X))
    info = aotgrad.cache_info(c)
    assert info.reasons[-1] == "environment variable ACT: 'relu' != 'gelu'"
    monkeypatch.delenv("ACT")
    torch.testing.assert_close(c(X), torch.relu(X))
    assert info.reasons[-1] == "environment variable ACT: 'relu' != unset"
    monkeypatch.setenv("ACT", "relu")
    torch.testing.assert_close(c(X), torch.relu(X))  # the first entry serves again
    assert info.misses == 3 and info.entries == 3


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda: os.getenv("ACT"), id="getenv"),
        pytest.param(lambda: "gelu" if "ACT" in os.environ else None, id="in"),
        pytest.param(lambda: _getitem("ACT"), id="getitem"),
        pytest.param(lambda: os.environ.copy().get("ACT"), id="copy"),
        pytest.param(lambda: dict(os.environ.items()).get("ACT"), id="items"),
        pytest.param(lambda: os.environb.get(b"ACT", b"").decode() or None, id="environb"),
        pytest.param(lambda: os.path.expandvars("$ACT").lstrip("$") or None, id="expandvars"),
    ],
)
def test_every_way_of_reading_is_keyed(monkeypatch, read):
    def f(x):
        return F.gelu(x) if read() == "gelu" else torch.relu(x)

    monkeypatch.delenv("ACT", raising=False)
    c = aotgrad.aot_function(f)
    torch.testing.assert_close(c(X), torch.relu(X))
    monkeypatch.setenv("ACT", "gelu")
    torch.testing.assert_close(c(X), F.gelu(X))
    assert aotgrad.cache_info(c).misses == 2


def test_reading_the_whole_environment_keys_all_of_it(monkeypatch):
    def f(x):
        return x * len([k for k in os.environ if k.startswith("AOTGRAD_TEST_")])

    monkeypatch.delenv("AOTGRAD_TEST_ONE", raising=False)
    c = aotgrad.aot_function(f)
    torch.testing.assert_close(c(X), f(X))
    monkeypatch.setenv("AOTGRAD_TEST_ONE", "1")
    torch.testing.assert_close(c(X), f(X))
    assert (
        aotgrad.cache_info(c).reasons[-1] == "environment variable AOTGRAD_TEST_ONE: unset != '1'"
    )
    traced = aotgrad.trace(f, X)
    assert traced.partitioned.joint.environ.what == "the whole environment"


def test_a_reference_taken_before_the_capture_is_seen(monkeypatch):
    from os import environ

    def f(x):
        return F.gelu(x) if environ.get("ACT") == "gelu" else torch.relu(x)

    monkeypatch.setenv("ACT", "relu")
    c = aotgrad.aot_function(f)
    torch.testing.assert_close(c(X), torch.relu(X))
    monkeypatch.setenv("ACT", "gelu")
    torch.testing.assert_close(c(X), F.gelu(X))


def test_torch_and_the_standard_library_reading_the_environment_do_not_count(monkeypatch):
    def f(x):
        torch.hub.get_dir()  # torch reads TORCH_HOME, XDG_CACHE_HOME; expanduser, for it, HOME
        return _act(x)

    monkeypatch.setenv("ACT", "relu")
    traced = aotgrad.trace(f, X)
    assert traced.partitioned.joint.environ.values == (("ACT", "relu"),)
    monkeypatch.setenv("TORCH_HOME", "/nonexistent/elsewhere")
    torch.testing.assert_close(traced(X), torch.relu(X))  # TORCH_HOME is not keyed


def test_another_thread_reading_during_a_capture_is_unaffected(monkeypatch):
    monkeypatch.setenv("ACT", "relu")
    monkeypatch.setenv("AOTGRAD_TEST_OTHER", "other")
    inside, read = threading.Event(), threading.Event()
    seen = []

    def reader():
        inside.wait(60)
        seen.append(
            (os.environ["AOTGRAD_TEST_OTHER"], os.getenv("AOTGRAD_TEST_OTHER"), len(os.environ) > 0)
        )
        read.set()

    def f(x):
        inside.set()
        read.wait(60)
        return _act(x)

    thread = threading.Thread(target=reader)
    thread.start()
    traced = aotgrad.trace(f, X)
    thread.join(60)
    assert seen == [("other", "other", True)]
    assert traced.partitioned.joint.environ.values == (("ACT", "relu"),)
    assert traced.partitioned.joint.environ.whole is None


def test_the_environment_is_put_back_after_a_failed_capture(monkeypatch):
    environ_type = type(os.environ)
    before = (environ_type.__getitem__, environ_type.__iter__, environ_type.__len__)

    def f(x):
        os.environ.get("ACT")
        raise ValueError("the user's error")

    with pytest.raises(Exception, match="the user's error"):
        aotgrad.trace(f, X)
    assert (environ_type.__getitem__, environ_type.__iter__, environ_type.__len__) == before
    assert os.environ.get("PATH") == os.getenv("PATH")


def test_a_traced_call_under_another_value_raises_and_save_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("ACT", "relu")
    traced = aotgrad.trace(_act, X)
    torch.testing.assert_close(traced(X), torch.relu(X))
    monkeypatch.setenv("ACT", "gelu")
    with pytest.raises(CallError, match="environment variable ACT: 'relu' != 'gelu'"):
        traced(X)
    with pytest.raises(StoreError, match="read environment variables ACT at capture"):
        traced.save(tmp_path / "act.aotgrad")


def test_a_function_that_reads_nothing_is_saved_and_cached(monkeypatch, tmp_path):
    traced = aotgrad.trace(lambda x: x * 2, X)
    assert traced.partitioned.joint.environ is None
    traced.save(tmp_path / "double.aotgrad")


def test_a_scan_body_is_captured_again_under_another_value(monkeypatch):
    def step(h, x):
        h = _act(h + x)
        return h, h

    def eager(h, xs):
        for x in xs:
            h = _act(h + x)
        return h

    run = aotgrad.scan_function(step)
    xs = torch.tensor([[-1.0, 0.5], [0.25, -2.0]])
    monkeypatch.setenv("ACT", "relu")
    torch.testing.assert_close(run(torch.zeros(2), xs)[0], eager(torch.zeros(2), xs))
    monkeypatch.setenv("ACT", "gelu")
    torch.testing.assert_close(run(torch.zeros(2), xs)[0], eager(torch.zeros(2), xs))
    assert run.captures == 2


DYNAMO = """
    import os, torch, aotgrad
    def f(x):
        if os.environ.get("ACT") == "gelu":
            return torch.nn.functional.gelu(x)
        return torch.relu(x)
    x = torch.tensor([-1.0, 0.5])
    print(torch.equal(torch.compile(f, backend="aotgrad")(x), f(x)))
"""


def test_dynamo_graphs_on_disk_are_not_stale_under_another_value(cache_dir):
    # Dynamo guards on the value and gives aotgrad another graph, keyed apart on disk.
    assert _python(DYNAMO, cache_dir, {"ACT": "relu"}) == ["True"]
    assert _python(DYNAMO, cache_dir, {"ACT": "gelu"}) == ["True"]


FIRST_CAPTURE = """
    import sys, torch, aotgrad
    def g(x):
        return x * 3
    c = aotgrad.aot_function(g)
    fresh = "torch._dynamo" not in sys.modules
    c(torch.ones(2))
    info = aotgrad.cache_info(c)
    print(fresh, "torch._dynamo" in sys.modules, info.disk_hits, info.disk_skipped)
"""


def test_what_torch_imports_during_a_first_capture_does_not_count(cache_dir):
    # The process's first capture imports Dynamo and sympy, which read SYMPY_* at import
    # (Note [Environment read at capture]): torch's imports, not g's reads.
    assert _python(FIRST_CAPTURE, cache_dir, {}) == ["True True 0 None"]
    # Served from disk: no capture, so Dynamo is never loaded.
    assert _python(FIRST_CAPTURE, cache_dir, {}) == ["True False 1 None"]


def test_a_module_the_function_imports_reading_the_environment_counts(monkeypatch, tmp_path):
    (tmp_path / "_aotgrad_env_reader.py").write_text(
        "import os\nSCALE = 2.0 if os.environ.get('SCALE_MODE') == 'double' else 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SCALE_MODE", "double")

    def f(x):
        import _aotgrad_env_reader  # first imported here, during the capture

        return x * _aotgrad_env_reader.SCALE

    try:
        traced = aotgrad.trace(f, X)
    finally:
        sys.modules.pop("_aotgrad_env_reader", None)
    assert traced.partitioned.joint.environ.values == (("SCALE_MODE", "double"),)
