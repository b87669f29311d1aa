"""Tensors the function stores in the user's objects (Note [Side effects replayed]).

Each case runs eager and compiled over several calls with different data and compares
the results, the gradients and what the user's lists, dicts and attributes hold.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

import aotgrad
from aotgrad.errors import StoreError, UnsupportedSideEffectError
from aotgrad.signature import SideEffect

RECORDED: list[torch.Tensor] = []  # a global list the functions below append to


def _fake(t):
    return isinstance(t, FakeTensor | FunctionalTensor)


def _no_fake_in(*values):
    """No fake tensor in these values, their lists, dicts, tuples and attributes."""
    stack = list(values)
    while stack:
        v = stack.pop()
        assert not _fake(v), v
        if isinstance(v, list | tuple):
            stack += v
        elif isinstance(v, dict):
            stack += v.values()
        elif isinstance(v, torch.nn.Module):
            stack += [w for k, w in vars(v).items() if not k.startswith("_")]
            stack += list(v.children())


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and not _fake(b)
        torch.testing.assert_close(b, a)
        assert b.requires_grad == a.requires_grad
        return
    if isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
        return
    assert a == b


class Recorder(torch.nn.Module):
    """Forward hooks record activations; the forward sets attributes and dict keys."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 4)
        self.fc2 = torch.nn.Linear(4, 2)
        self.acts: list[torch.Tensor] = []
        self.stats: dict[str, torch.Tensor] = {}
        self.fc1.register_forward_hook(lambda m, i, out: self.acts.append(out.detach()))

    def forward(self, x):
        h = self.fc1(x).relu()
        self.cache = h.mean()  # (d) an attribute set from a computed, differentiable tensor
        self.stats["h"] = h.detach().sum(0)  # (d) a dict key
        RECORDED.append(h.detach() * 2)  # (e) a global list
        return self.fc2(h).sum()


def _run_recorder(compile_fn, calls=3):
    torch.manual_seed(0)
    model = Recorder()
    features: dict[str, tuple[str, torch.Tensor]] = {}
    model.fc2.register_forward_hook(lambda m, i, out: features.__setitem__("fc2", ("out", out)))
    RECORDED.clear()
    run = compile_fn(model)
    seen = []
    for k in range(calls):
        x = torch.randn(5, 3) + k
        loss = run(x)
        loss.backward()
        seen.append(
            (
                loss.detach(),
                model.fc1.weight.grad.clone(),
                model.cache.detach(),
                model.cache.requires_grad,
                [a.clone() for a in model.acts],
                dict(model.stats),
                features["fc2"][0],
                features["fc2"][1].detach(),
                features["fc2"][1].requires_grad,
                list(RECORDED),
            )
        )
    _no_fake_in(model, features, RECORDED)
    return seen, model


@pytest.mark.parametrize("frontend", ["aot_module", "aot_function"])
def test_hooks_attributes_and_globals_match_eager_over_calls(frontend):
    """(a) forward hooks recording into a module list and a closure dict, (d) attributes and
    dict keys set from computed tensors, (e) a global list: eager's values on every call."""
    if frontend == "aot_module":
        compile_fn = aotgrad.aot_module
    else:
        compile_fn = lambda model: aotgrad.aot_function(lambda x: model(x))  # noqa: E731
    expected, _ = _run_recorder(lambda model: model)
    got, model = _run_recorder(compile_fn)
    for e, g in zip(expected, got, strict=True):
        _assert_same(e, g)
    assert all(not a.requires_grad for a in model.acts)  # recorded detached, as in eager
    assert model.cache.grad_fn is not None  # differentiable, as in eager


def test_stored_differentiable_attribute_carries_gradients():
    """``self.cache = h.mean()``: backward through the stored tensor reaches the parameters."""
    eager, compiled = Recorder(), Recorder()
    compiled.load_state_dict(eager.state_dict())
    f = aotgrad.aot_module(compiled)
    x = torch.randn(5, 3)
    eager(x)
    f(x)
    eager.cache.backward()
    compiled.cache.backward()
    torch.testing.assert_close(compiled.fc1.weight.grad, eager.fc1.weight.grad)


def test_signature_describes_the_stores():
    model = Recorder()
    RECORDED.clear()
    traced = aotgrad.trace(model, torch.randn(5, 3))
    stores = [str(d) for d in traced.signature.forward_outputs if isinstance(d, SideEffect)]
    assert "side effect self.acts.append(·)" in stores
    assert "side effect self.cache = ·" in stores
    assert "side effect self.stats['h'] = ·" in stores
    assert "side effect global RECORDED.append(·)" in stores
    _no_fake_in(model, RECORDED)
    assert model.acts == [] and RECORDED == [] and "cache" not in vars(model)
    x = torch.randn(5, 3)
    out = traced(x)
    (recorded,) = RECORDED
    eager = Recorder()
    eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model.acts[-1], eager.acts[-1])
    torch.testing.assert_close(recorded, RECORDED[-1])


def test_closure_list_of_a_hook_in_aot_function():
    """Grad-CAM style: a hook appends to a list it closes over; aot_function of a closure."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    feats: list[torch.Tensor] = []
    lin.register_forward_hook(lambda m, i, out: feats.append(out.detach()))
    f = aotgrad.aot_function(lambda x: lin(x).tanh().sum())
    xs = [torch.randn(2, 3) for _ in range(3)]
    for x in xs:
        f(x)
    assert len(feats) == 3 and not any(f.requires_grad for f in feats)
    for x, feat in zip(xs, feats, strict=True):
        torch.testing.assert_close(feat, torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert aotgrad.cache_info(f).misses == 1  # the hook's list is not an input: one trace


def test_replay_follows_a_rebound_attribute():
    model = Recorder()
    f = aotgrad.aot_module(model)
    f(torch.randn(5, 3))
    model.acts = []  # the user resets the list between steps
    x = torch.randn(5, 3)
    f(x)
    assert len(model.acts) == 1
    expected = torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias)
    torch.testing.assert_close(model.acts[0], expected.detach())


def _weight_norm_run(compile_fn):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lin = torch.nn.utils.weight_norm(torch.nn.Linear(3, 2))
    run = compile_fn(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    seen = []
    for _ in range(3):
        x = torch.randn(4, 3)
        loss = run(x).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        seen.append((loss.detach(), lin.weight_g.grad.clone(), lin.weight_v.grad.clone()))
        opt.step()
        assert not _fake(lin.weight)
        seen.append((lin.weight.detach().clone(),))
    return seen


@pytest.mark.parametrize("frontend", ["aot_module", "torch.compile"])
def test_legacy_weight_norm_matches_eager(frontend):
    """(c) the weight_norm pre-hook sets ``module.weight``: a real tensor with history every
    call; the next call and its backward run as in eager."""
    if frontend == "aot_module":
        compile_fn = aotgrad.aot_module
    else:
        compile_fn = lambda m: torch.compile(m, backend="aotgrad")  # noqa: E731
    expected = _weight_norm_run(lambda m: m)
    got = _weight_norm_run(compile_fn)
    for e, g in zip(expected, got, strict=True):
        _assert_same(list(e), list(g))


def test_unused_input_with_a_spent_graph():
    """An input no output reaches, whose own graph's backward already ran: eager runs."""
    w = torch.randn(3, requires_grad=True)
    h = w * 2
    h.sum().backward()
    f = aotgrad.aot_function(lambda x, h: (x * 3).sum())
    x = torch.randn(3, requires_grad=True)
    f(x, h).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))


def test_full_backward_hook_recording_is_refused_at_its_line():
    """(b) a full backward hook records grad_output: the compiled backward runs no Python."""
    model = Recorder()
    grads: list[torch.Tensor] = []
    model.fc2.register_full_backward_hook(lambda m, gi, go: grads.append(go[0]))  # HOOK LINE
    f = aotgrad.aot_module(model)
    with pytest.raises(UnsupportedSideEffectError, match="while the backward was traced") as e:
        f(torch.randn(5, 3, requires_grad=True))
    assert "HOOK LINE" in str(e.value)
    assert grads == [] and model.acts == []
    _no_fake_in(model)


class _Box:
    def __init__(self, t):
        self.t = t


def test_unrebuildable_store_is_refused_and_leaves_nothing():
    lin = torch.nn.Linear(3, 3)
    boxes: list[_Box] = []
    lin.register_forward_hook(lambda m, i, out: boxes.append(_Box(out)))  # BOX LINE
    f = aotgrad.aot_function(lambda x: lin(x).sum())
    with pytest.raises(UnsupportedSideEffectError, match="_Box holding traced tensors") as e:
        f(torch.randn(2, 3))
    assert "BOX LINE" in str(e.value)
    assert boxes == []


def test_list_changed_other_than_by_append_is_refused():
    history = [torch.zeros(3)]

    def f(x):
        y = x.sin()
        history[0] = y  # replaces an item
        return y.sum()

    with pytest.raises(UnsupportedSideEffectError, match="other than appending"):
        aotgrad.aot_function(f)(torch.randn(3))
    assert len(history) == 1 and not _fake(history[0])


def test_stores_are_not_written_to_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTGRAD_CACHE", "1")
    monkeypatch.setenv("AOTGRAD_CACHE_DIR", str(tmp_path / "cache"))
    store: dict[str, torch.Tensor] = {}

    def f(x):
        y = x.cos()
        store["y"] = y
        return y * 2

    compiled = aotgrad.aot_function(f)
    x = torch.randn(3)
    compiled(x)
    info = aotgrad.cache_info(compiled)
    assert info.disk_skipped is not None
    torch.testing.assert_close(store["y"], x.cos())
    with pytest.raises(StoreError, match="stores tensors in the user's objects"):
        aotgrad.trace(f, x).save(tmp_path / "f.aotgrad")


def test_python_side_effects_without_tensors_run_at_capture_only():
    calls: list[int] = []

    def f(x):
        calls.append(1)
        return x * 2

    compiled = aotgrad.aot_function(f)
    compiled(torch.ones(2))
    compiled(torch.ones(2))
    assert calls == [1]  # as before: a Python side effect runs at capture


def test_scan_body_storing_tensors_is_refused():
    seen: list[torch.Tensor] = []

    def body(carry, x):
        y = carry + x
        seen.append(y.detach())
        return y, y * 2

    with pytest.raises(UnsupportedSideEffectError, match="scan body stores tensors"):
        aotgrad.scan(body, torch.zeros(3), torch.randn(4, 3))
    assert seen == []


def test_grad_cam_tensor_hook_is_refused_and_torch_compile_records():
    """Grad-CAM: a forward hook keeps the activation and registers a tensor hook for its
    gradient. The activation could be stored again, the gradient (recorded in the backward)
    cannot: refused at the hook's line. torch.compile(backend="aotgrad") records both."""

    def model_and_records():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        records: dict[str, torch.Tensor] = {}

        def keep(module, inputs, out):
            records["act"] = out.detach()
            out.register_hook(lambda g: records.__setitem__("grad", g))  # GRAD LINE

        model[1].register_forward_hook(keep)
        return model, records

    model, records = model_and_records()
    with pytest.raises(UnsupportedSideEffectError, match="while the backward was traced") as e:
        aotgrad.aot_module(model)(torch.randn(2, 3))
    assert "keep" in str(e.value) or "GRAD LINE" in str(e.value)
    assert records == {}

    eager_model, eager_records = model_and_records()
    compiled_model, compiled_records = model_and_records()
    compiled = torch.compile(compiled_model, backend="aotgrad")
    for _ in range(2):
        x = torch.randn(2, 3)
        eager_model(x).sum().backward()
        compiled(x).sum().backward()
        _assert_same(eager_records, compiled_records)


class _EMA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        y = self.fc(x)
        self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)  # rebinds the buffer
        return y.sum()


@pytest.mark.parametrize("tracer", ["auto", "full"])
def test_buffer_rebound_in_forward_matches_eager(tracer):
    """``self.avg = ...`` on a registered buffer: eager's running average on every call
    (it was dropped: the capture's swap put the old buffer back)."""

    def run(compile_fn):
        torch.manual_seed(0)
        model = _EMA()
        f = compile_fn(model)
        seen = []
        for k in range(3):
            f(torch.randn(2, 3) + k).backward()
            assert "avg" in model._buffers and not _fake(model.avg)
            seen.append((model.avg.clone(), model.fc.weight.grad.clone()))
        return seen

    expected = run(lambda m: m)
    got = run(lambda m: aotgrad.aot_module(m, tracer=tracer))
    for e, g in zip(expected, got, strict=True):
        _assert_same(list(e), list(g))


def test_global_module_hook_and_dynamic_shapes():
    """A global forward hook (register_module_forward_hook) recording outputs, under
    dynamic shapes: each call's real output, of each call's size."""
    seen: list[torch.Tensor] = []

    def record(module, inputs, out):
        if isinstance(module, torch.nn.Linear):
            seen.append(out.detach())

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        lin = torch.nn.Linear(3, 2)
        f = aotgrad.aot_module(lin, dynamic=True)
        xs = [torch.randn(n, 3) for n in (2, 5, 7)]
        for x in xs:
            f(x)
    finally:
        handle.remove()
    assert [t.shape[0] for t in seen] == [2, 5, 7]
    for x, t in zip(xs, seen, strict=True):
        torch.testing.assert_close(t, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_defaultdict_of_lists_is_appended_to():
    """``feats[name].append(out)`` on a ``defaultdict(list)``: eager's lists over calls."""
    import collections

    def run(compile_fn):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        feats: collections.defaultdict[str, list[torch.Tensor]] = collections.defaultdict(list)
        model[0].register_forward_hook(lambda m, i, out: feats["fc"].append(out.detach()))
        f = compile_fn(model)
        for k in range(3):
            f(torch.randn(2, 3) + k)
        return dict(feats)

    expected = run(lambda m: m)
    got = run(aotgrad.aot_module)
    _assert_same(expected, got)
    assert len(got["fc"]) == 3


def test_new_list_under_a_new_key_is_refused():
    """``feats.setdefault(k, []).append(out)`` and ``feats[k] = [out]`` look alike at the
    first capture and differ from the second call on: refused, nothing left behind."""
    lin = torch.nn.Linear(3, 3)
    feats: dict[str, list[torch.Tensor]] = {}
    lin.register_forward_hook(lambda m, i, out: feats.setdefault("fc", []).append(out))
    with pytest.raises(UnsupportedSideEffectError, match="cannot tell whether later calls"):
        aotgrad.aot_module(lin)(torch.randn(2, 3))
    assert feats == {}


def test_container_mixing_old_and_traced_tensors_is_refused():
    history: dict[str, list[torch.Tensor]] = {"h": [torch.zeros(3)]}

    def f(x):
        y = x.sin()
        history["h"] = [*history["h"], y]  # a new list with the old items
        return y.sum()

    with pytest.raises(UnsupportedSideEffectError, match="tensors from before the call"):
        aotgrad.aot_function(f)(torch.randn(3))
    assert len(history["h"]) == 1 and not _fake(history["h"][0])
