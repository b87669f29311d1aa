"""The disk cache is never stale and trusts only what its owner wrote (docs/caching.md,
Trust model): keys of code and torch settings, folder and entry checks, eviction, the
size setting, reports after a hit."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotgrad
from aotgrad.cache.specializations import SETTINGS, ambient_key
from aotgrad.errors import ConfigError
from aotgrad.store import disk

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _entries(directory):
    return sorted(directory.glob("*/*.aotgrad"))


def _compiled_here(source, **names):
    """A function made from ``source`` under this file's name (as ``exec`` of generated
    code does): same module, same file, same first line for every ``source``."""
    namespace = {"__name__": __name__, **names}
    exec(compile(source, __file__, "exec"), namespace)
    return namespace["f"]


# -- 5. keys of code (Note [Keys of code]) ---------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "call"),
    [
        # one line, the same bytecode, parameters in another order
        ("f = lambda a, b: b - a", "f = lambda b, a: a - b", {"a": 1.0, "b": 3.0}),
        # another default value
        ("f = lambda x, k=2.0: x * k", "f = lambda x, k=-100.0: x * k", {}),
        ("f = lambda x, *, k=2.0: x * k", "f = lambda x, *, k=3.0: x * k", {}),
        # constants that compare equal: 0.0 == -0.0
        ("f = lambda x: x.copysign(0.0)", "f = lambda x: x.copysign(-0.0)", {}),
    ],
)
def test_functions_that_differ_only_in_their_code_object_get_other_keys(
    cache_dir, first, second, call
):
    x = torch.ones(3)
    for source in (first, second):
        fn = _compiled_here(source)
        args = {name: x * value for name, value in call.items()} or {"x": x}
        expected = fn(**args)
        got = aotgrad.aot_function(fn)(**args)
        torch.testing.assert_close(got, expected, equal_nan=True)
    assert len(_entries(cache_dir)) == 2


def test_a_helper_made_by_exec_is_part_of_the_key(cache_dir):
    """The function reaches ``helper`` by a global name; its code is in no file."""
    x = torch.ones(3)
    for helper_source in ("def f(a, b):\n    return b - a\n", "def f(b, a):\n    return a - b\n"):
        helper = _compiled_here(helper_source)
        fn = _compiled_here("def f(x):\n    return helper(a=x, b=x * 3)\n", helper=helper)
        got = aotgrad.aot_function(fn)(x)
        torch.testing.assert_close(got, fn(x))
    assert len(_entries(cache_dir)) == 2


def test_a_method_made_by_exec_is_part_of_a_modules_key(cache_dir):
    x = torch.ones(3)
    for factor in (2.0, -100.0):
        forward = _compiled_here(f"def f(self, x):\n    return x * {factor}\n")
        cls = type("Scaled", (torch.nn.Module,), {"forward": forward, "__module__": __name__})
        model = cls()
        torch.testing.assert_close(aotgrad.aot_module(model)(x), model(x))
    assert len(_entries(cache_dir)) == 2


# -- 5. torch settings in the key (Note [Torch settings in the key]) -------------------------


@contextlib.contextmanager
def _opt_einsum(name, value):
    globals_ = torch.backends.opt_einsum._get_enabled.__globals__
    old = globals_[name]
    globals_[name] = value  # its setter refuses while the package is not installed
    try:
        yield
    finally:
        globals_[name] = old


@contextlib.contextmanager
def _restored(flip, restore):
    flip()
    try:
        yield
    finally:
        restore()


_PRIORITY = torch._C._get_sdp_priority_order()
# For every entry of SETTINGS: a context that flips it.
FLIPS = {
    "flash_sdp": lambda: _restored(
        lambda: torch.backends.cuda.enable_flash_sdp(False),
        lambda: torch.backends.cuda.enable_flash_sdp(True),
    ),
    "mem_efficient_sdp": lambda: _restored(
        lambda: torch.backends.cuda.enable_mem_efficient_sdp(False),
        lambda: torch.backends.cuda.enable_mem_efficient_sdp(True),
    ),
    "math_sdp": lambda: _restored(
        lambda: torch.backends.cuda.enable_math_sdp(False),
        lambda: torch.backends.cuda.enable_math_sdp(True),
    ),
    "cudnn_sdp": lambda: _restored(
        lambda: torch.backends.cuda.enable_cudnn_sdp(False),
        lambda: torch.backends.cuda.enable_cudnn_sdp(True),
    ),
    "overrideable_sdp": lambda: _restored(
        lambda: torch._C._set_sdp_use_overrideable(False),
        lambda: torch._C._set_sdp_use_overrideable(True),
    ),
    "sdp_priority": lambda: _restored(
        lambda: torch._C._set_sdp_priority_order(sorted(_PRIORITY)),
        lambda: torch._C._set_sdp_priority_order(_PRIORITY),
    ),
    "math_sdp_reduction": lambda: _restored(
        lambda: torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True),
        lambda: torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False),
    ),
    "deterministic": lambda: _restored(
        lambda: torch.use_deterministic_algorithms(True),
        lambda: torch.use_deterministic_algorithms(False),
    ),
    "cudnn": lambda: torch.backends.cudnn.flags(enabled=False),
    "mkldnn": lambda: torch.backends.mkldnn.flags(enabled=False),
    "mha_fastpath": lambda: _restored(
        lambda: torch.backends.mha.set_fastpath_enabled(False),
        lambda: torch.backends.mha.set_fastpath_enabled(True),
    ),
    "opt_einsum": lambda: _opt_einsum("enabled", not torch.backends.opt_einsum._get_enabled()),
    "opt_einsum_strategy": lambda: _opt_einsum("strategy", "greedy"),
    "default_device": lambda: torch.device("meta"),
}


def test_every_setting_has_a_test():
    assert set(FLIPS) == {name for name, _ in SETTINGS}


def _attention(q):
    return F.scaled_dot_product_attention(q, q, q).sum()


@pytest.mark.parametrize("name", [name for name, _ in SETTINGS])
def test_each_setting_changes_the_key_in_memory_and_on_disk(cache_dir, name):
    q = torch.randn(2, 2, 8, 16, requires_grad=True)
    compiled = aotgrad.aot_function(_attention)
    compiled(q)
    default = ambient_key()
    with FLIPS[name]():
        assert ambient_key() != default
        expected = _attention(q)
        fresh = aotgrad.aot_function(_attention)  # as a new process: it looks on disk
        torch.testing.assert_close(fresh(q), expected)
        got = compiled(q)
    torch.testing.assert_close(got, expected)
    info = aotgrad.cache_info(compiled)
    assert info.misses == 2 and info.reasons[-1].startswith(f"torch setting {name} "), info
    assert aotgrad.cache_info(fresh).disk_hits == 0
    assert len(_entries(cache_dir)) == 2
    assert ambient_key() == default


def _ops(graph):
    return {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}


def test_sdpa_kernel_math_traces_the_math_graph(cache_dir):
    """Process B under MATH must not get process A's flash graph (the issue's case)."""
    q = torch.randn(2, 2, 8, 16, requires_grad=True)
    first = aotgrad.aot_function(_attention)
    first(q)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in _ops(
        first.partitioned.forward
    )
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.autograd.grad(_attention(q), q)[0]
        compiled = aotgrad.aot_function(_attention)
        got = torch.autograd.grad(compiled(q), q)[0]
        forward = _ops(compiled.partitioned.forward)
    torch.testing.assert_close(got, expected)
    assert "aten.bmm.default" in forward
    assert not any("flash" in op for op in forward)


def test_mha_fastpath_follows_eager():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    compiled = aotgrad.aot_module(mha)
    for enabled in (True, False):
        with torch.no_grad(), FLIPS["mha_fastpath"]() if not enabled else contextlib.nullcontext():
            torch.testing.assert_close(compiled(x, x, x)[0], mha(x, x, x)[0])
    assert aotgrad.cache_info(compiled).misses == 2


def _ramp(x):
    return torch.arange(3.0) + x


def test_the_default_device_follows_eager(cache_dir):
    x = torch.tensor(1.0)
    compiled = aotgrad.aot_function(_ramp)
    assert compiled(x).device.type == "cpu"
    with torch.device("meta"):
        assert _ramp(x).device.type == "meta"
        assert compiled(x).device.type == "meta"
        assert aotgrad.aot_function(_ramp)(x).device.type == "meta"  # not the cpu entry


# -- 6. who may write the cache (Note [Who may write the cache]) ------------------------------


def _double(x):
    return x * 2


def _planted(x):
    return x * -100


def _plant(cache_dir):
    """Put ``_planted``'s graphs under ``_double``'s key (as another user could)."""
    x = torch.ones(2)
    aotgrad.aot_function(_double)(x)
    (victim,) = _entries(cache_dir)
    victim.unlink()
    aotgrad.aot_function(_planted)(x)
    (attacker,) = _entries(cache_dir)
    victim.parent.mkdir(exist_ok=True)
    attacker.rename(victim)
    return victim


def _run_victim():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = aotgrad.aot_function(_double)
        out = f(torch.ones(2))
        aotgrad.aot_function(_double)(torch.ones(3))
    return out, aotgrad.cache_info(f), [str(w.message) for w in caught]


def test_the_cache_folder_is_made_private(cache_dir):
    aotgrad.aot_function(_double)(torch.ones(2))
    (entry,) = _entries(cache_dir)
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    assert entry.parent.stat().st_mode & 0o777 == 0o700
    assert entry.stat().st_mode & 0o077 == 0


def test_a_folder_others_can_write_is_not_read(cache_dir):
    _plant(cache_dir)
    cache_dir.chmod(0o777)
    out, info, messages = _run_victim()
    assert out.tolist() == [2.0, 2.0]
    assert "writable by others" in info.disk_skipped and info.disk_hits == 0
    assert len(messages) == 1 and str(cache_dir) in messages[0]  # warned once


def test_a_shard_others_can_write_is_not_read(cache_dir):
    victim = _plant(cache_dir)
    victim.parent.chmod(0o777)
    out, info, _ = _run_victim()
    assert out.tolist() == [2.0, 2.0] and info.disk_hits == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_folder_of_another_user_is_not_read(cache_dir):
    _plant(cache_dir)
    os.chown(cache_dir, 4242, 4242)
    out, info, messages = _run_victim()
    assert out.tolist() == [2.0, 2.0]
    assert "owned by another user (uid 4242)" in info.disk_skipped
    assert len(messages) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_an_entry_of_another_user_is_not_read(cache_dir):
    victim = _plant(cache_dir)
    os.chown(victim, 4242, 4242)
    out, info, _ = _run_victim()
    assert out.tolist() == [2.0, 2.0] and info.disk_hits == 0


def test_links_in_the_folder_are_not_followed(cache_dir, tmp_path):
    victim = _plant(cache_dir)
    elsewhere = tmp_path / "elsewhere"
    victim.parent.rename(elsewhere)
    victim.parent.symlink_to(elsewhere)  # a shard that is a link
    out, info, _ = _run_victim()
    assert out.tolist() == [2.0, 2.0] and info.disk_hits == 0
    victim.parent.unlink()
    victim.parent.mkdir(mode=0o700)
    victim.symlink_to(elsewhere / victim.name)  # an entry that is a link
    out, info, _ = _run_victim()
    assert out.tolist() == [2.0, 2.0] and info.disk_hits == 0


# -- 7. only regular files are read ----------------------------------------------------------


FIFO_SCRIPT = """
import os, sys, torch, aotgrad
sys.path.insert(0, {tests!r})
from test_cache_trust import _double
f = aotgrad.aot_function(_double)
print(f(torch.ones(2)).tolist(), aotgrad.cache_info(f).disk_hits)
"""


def _python(script, cache_dir, timeout=120):
    env = {**os.environ, "AOTGRAD_CACHE": "1", "AOTGRAD_CACHE_DIR": str(cache_dir)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_a_fifo_planted_as_an_entry_is_a_miss_not_a_hang(cache_dir):
    script = FIFO_SCRIPT.format(tests=str(ROOT / "tests"))
    assert _python(script, cache_dir) == ["[2.0, 2.0] 0"]
    assert _python(script, cache_dir) == ["[2.0, 2.0] 1"]
    (entry,) = _entries(cache_dir)
    entry.unlink()
    os.mkfifo(entry)
    start = time.monotonic()
    (line,) = _python(script, cache_dir, timeout=60)
    assert line == "[2.0, 2.0] 0"
    assert time.monotonic() - start < 60


def test_load_of_a_fifo_or_a_directory_is_a_store_error_not_a_hang(tmp_path):
    fifo = tmp_path / "planted.aotgrad"
    os.mkfifo(fifo)
    script = (
        "import aotgrad, sys\n"
        "try:\n"
        f"    aotgrad.load({str(fifo)!r})\n"
        "except aotgrad.StoreError as e:\n"
        "    print('StoreError', 'not a regular file' in str(e))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["StoreError", "True"], out.stderr
    with pytest.raises(aotgrad.StoreError, match="cannot read"):
        aotgrad.load(tmp_path)


# -- 8. eviction deletes only aotgrad's own files ----------------------------------------------


def test_eviction_spares_a_users_files_and_cleans_old_temporary_files(cache_dir, monkeypatch):
    aotgrad.aot_function(_double)(torch.ones(2))
    (entry,) = _entries(cache_dir)
    shard = entry.parent
    saved = shard / "model.aotgrad"
    aotgrad.trace(_double, torch.ones(2)).save(saved)
    readme = cache_dir / "notes.aotgrad"
    readme.write_text("mine")
    key = entry.name.removesuffix(".aotgrad")
    old = shard / f".{key}.aotgrad.abc123.tmp"
    young = shard / f".{key}.aotgrad.def456.tmp"
    for path in (old, young):
        path.write_bytes(b"x" * 10)
    hours_ago = time.time() - 7200
    os.utime(old, (hours_ago, hours_ago))
    monkeypatch.setenv("AOTGRAD_CACHE_SIZE_MB", "0")
    aotgrad.aot_function(_double)(torch.ones(5))  # a write, then eviction down to nothing
    assert saved.exists() and readme.exists() and young.exists()
    assert not old.exists()
    assert not _entries(cache_dir) or _entries(cache_dir) == [saved]
    assert aotgrad.load(saved)(torch.ones(2)).tolist() == [2.0, 2.0]


# -- 9. AOTGRAD_CACHE_SIZE_MB --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "abc", "1e400"])
def test_a_bad_cache_size_is_a_clear_error(cache_dir, monkeypatch, value):
    monkeypatch.setenv("AOTGRAD_CACHE_SIZE_MB", value)
    f = aotgrad.aot_function(_double)
    with pytest.raises(ConfigError, match=r"AOTGRAD_CACHE_SIZE_MB=.*finite number of megabytes"):
        f(torch.ones(2))


@pytest.mark.parametrize("value", ["flase", "2", "enabled"])
def test_a_bad_cache_switch_is_a_clear_error(cache_dir, monkeypatch, value):
    monkeypatch.setenv("AOTGRAD_CACHE", value)
    f = aotgrad.aot_function(_double)
    with pytest.raises(ConfigError, match=r"AOTGRAD_CACHE=.*expected one of 1, true, on, yes"):
        f(torch.ones(2))


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("1.5", 3 << 19), (" 2 ", 2 << 20)])
def test_good_cache_sizes(value, expected):
    assert disk.disk_cache({"AOTGRAD_CACHE_SIZE_MB": value}).max_bytes == expected


# -- 10. reports after a disk hit (Note [Reports after a disk hit]) -----------------------------


REPORT_SCRIPT = """
import json, pathlib, sys, tempfile, torch, aotgrad
sys.path.insert(0, {tests!r})
from models import GPT
torch.manual_seed(0)
model = GPT()
idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
compiled = aotgrad.aot_module(model)
compiled(idx, targets).backward()
page = pathlib.Path(tempfile.mkdtemp()) / "report.html"
compiled.to_html(page)
print(json.dumps({{
    "hits": aotgrad.cache_info(compiled).disk_hits,
    "memory": compiled.memory_report(),
    "by_module": compiled.memory_report(by_module=True),
    "seq": str(compiled.seq_table()),
    "html": len(page.read_text()),
}}))
"""


def test_reports_after_a_hit_in_another_process_are_the_same(tmp_path):
    script = REPORT_SCRIPT.format(tests=str(ROOT / "tests"))
    miss, hit = (json.loads(_python(script, tmp_path / "cache", timeout=300)[-1]) for _ in range(2))
    assert (miss["hits"], hit["hits"]) == (0, 1)
    for report in ("memory", "by_module", "seq", "html"):
        assert hit[report] == miss[report], report
    assert "read by backward op" in hit["memory"] and "SeqNr" in hit["seq"]


def _linear_loss(w, x):
    return (x @ w).tanh().sum()


def test_reports_after_a_hit_trace_once_and_compile_nothing(cache_dir, tmp_path):
    w, x = torch.randn(4, 3, requires_grad=True), torch.randn(2, 4)
    first = aotgrad.aot_function(_linear_loss)
    first(w, x)
    compiled_graphs = []

    def compiler(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm

    second = aotgrad.aot_function(_linear_loss, fw_compiler=compiler, bw_compiler=compiler)
    second(w, x).backward()
    assert aotgrad.cache_info(second).disk_hits == 1
    loaded = len(compiled_graphs)
    assert second.memory_report() == first.memory_report()
    assert str(second.seq_table()) == str(first.seq_table())
    second.to_html(tmp_path / "report.html")
    assert "tanh" in (tmp_path / "report.html").read_text()
    assert len(compiled_graphs) == loaded  # traced for the report, not compiled
    assert second.partitioned.forward.code == first.partitioned.forward.code


def test_reports_after_a_hit_under_no_grad(cache_dir):
    w, x = torch.randn(4, 3, requires_grad=True), torch.randn(2, 4)
    with torch.no_grad():
        first = aotgrad.aot_function(_linear_loss)
        first(w, x)
        second = aotgrad.aot_function(_linear_loss)
        second(w, x)
    assert aotgrad.cache_info(second).disk_hits == 1
    assert str(second.seq_table()) == str(first.seq_table())


GLOBAL_SCALE = 2.0


def _global_scaled(x):
    return x * GLOBAL_SCALE


def test_a_report_after_the_key_changed_is_refused(cache_dir, monkeypatch):
    aotgrad.aot_function(_global_scaled)(torch.ones(2, requires_grad=True))
    second = aotgrad.aot_function(_global_scaled)
    second(torch.ones(2, requires_grad=True))
    assert aotgrad.cache_info(second).disk_hits == 1
    monkeypatch.setitem(globals(), "GLOBAL_SCALE", 3.0)
    with pytest.raises(aotgrad.CallError, match=r"GLOBAL_SCALE.*2\.0 != 3\.0"):
        second.memory_report()


def test_a_function_patched_into_a_module_is_part_of_the_key(cache_dir, monkeypatch):
    """``helpers.act`` replaced at run time: the module's file is unchanged."""
    helpers = types.ModuleType("trust_helpers")
    helpers.__file__ = __file__
    monkeypatch.setitem(sys.modules, "trust_helpers", helpers)
    fn = _compiled_here("def f(x):\n    return trust_helpers.act(x)\n", trust_helpers=helpers)
    x = torch.ones(3)
    for act in ("lambda x: x * 2", "lambda x: x * -100"):
        helpers.act = _compiled_here(f"f = {act}")
        torch.testing.assert_close(aotgrad.aot_function(fn)(x), fn(x))
    assert len(_entries(cache_dir)) == 2


class _Config:
    """An object without a stable text."""


class _Built(torch.nn.Module):
    def __init__(self, config=_Config()):  # noqa: B008 (the case: a default object)
        super().__init__()
        self.scale = 2.0

    def forward(self, x):
        return x * self.scale


def test_a_modules_init_defaults_do_not_stop_caching(cache_dir):
    x = torch.ones(2)
    for hits in (0, 1):
        compiled = aotgrad.aot_module(_Built())
        assert compiled(x).tolist() == [2.0, 2.0]
        info = aotgrad.cache_info(compiled)
        assert (info.disk_hits, info.disk_skipped) == (hits, None)


def _with_default(x, config=_Config()):  # noqa: B008 (the case: a default object)
    return x * 2


def test_a_default_without_stable_text_is_not_cached(cache_dir):
    compiled = aotgrad.aot_function(_with_default)
    assert compiled(torch.ones(2)).tolist() == [2.0, 2.0]
    assert "_Config has no stable key" in aotgrad.cache_info(compiled).disk_skipped
