"""Reading a module's state each call (Note [Reading a module, fast]) keys exactly as the plain loop.

``_reference_module`` is ``_Walk._module`` as it was before the fast path: one
``named_modules()`` pass, every ``vars(sub)`` entry filtered by ``_MODULE_FIELDS``.
Every module of the zoo, after every change, must give the same tensors, names,
labels and keys through both; and every change must still re-trace.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.signature import closures, values
from aotgrad.signature.closures import (
    _LABELS,
    _MODULE_FIELDS,
    _PLAIN,
    MODULE_HOOKS,
    Environment,
    is_fsdp_bookkeeping,
    read_environment,
)
from aotgrad.signature.lifting import State


def _reference_module(self: Any, kind: Any, name: str, module: nn.Module, with_state: bool) -> None:
    if id(module) in self._seen:
        return
    self.saw_module = True
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    attributes: list[tuple[str, Any]] = []
    labels, keys = self.labels, self.keys
    for relative, sub in module.named_modules():
        self._seen.add(id(sub))
        prefix = f"{name}.{relative}." if relative else f"{name}."
        params += ((prefix + n, p) for n, p in sub._parameters.items() if p is not None)
        buffers += ((prefix + n, b) for n, b in sub._buffers.items() if b is not None)
        state = vars(sub)
        for hooks in MODULE_HOOKS:
            if state.get(hooks):
                labels.append(f"{_LABELS[kind]} {prefix}{hooks}")
                keys.append(tuple(state[hooks].items()))
        for a, v in state.items():
            if a in _MODULE_FIELDS or is_fsdp_bookkeeping(v):
                continue
            cls = type(v)
            if cls in _PLAIN:
                labels.append(f"{_LABELS[kind]} {prefix}{a}")
                keys.append((cls, v))
            else:
                attributes.append((prefix + a, v))
    start = len(name) + 1
    for found, into in ((params, self.params), (buffers, self.buffers)):
        for qualname, t in found:
            if id(t) in self._seen:
                continue
            if with_state:
                self._tensor(kind, qualname, t)
            else:
                self._seen.add(id(t))
                into.append((qualname[start:], t))
    for label, value in attributes:
        self.visit(kind, label, value)


def _both(monkeypatch: pytest.MonkeyPatch, read: Callable[[], Environment]) -> None:
    fast = read()
    with monkeypatch.context() as patch:
        patch.setattr(closures._Walk, "_module", _reference_module)
        plain = read()
    assert fast.sources == plain.sources
    assert fast.labels == plain.labels
    assert fast.keys == plain.keys
    assert [id(t) for t in fast.tensors] == [id(t) for t in plain.tensors]
    for mine, theirs in ((fast.params, plain.params), (fast.buffers, plain.buffers)):
        assert [(n, id(t)) for n, t in mine] == [(n, id(t)) for n, t in theirs]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = 2.0
        self.name = "scaled"
        self.config = {"eps": 1e-5, "table": torch.ones(2)}  # a tensor in a value: lifted
        self.register_buffer("count", torch.zeros(()))
        self.pair = (torch.ones(2), 3)  # a tuple holding a tensor: split, the tensor lifted
        self.shape = (3, 1e-5, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.count


class _Shared(nn.Module):
    """One submodule under two names, one weight tied across two Linears, a None child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), self.a)
        self.b[0].weight = self.a.weight
        self.empty: nn.Module | None = None
        self.register_module("missing", None)
        self.register_buffer("gone", None)
        self.register_parameter("unset", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class _OwnWalk(nn.Sequential):
    """A module class with its own ``named_modules``: it hides its second child."""

    def named_modules(
        self, memo: Any = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[Any]:
        for name, module in super().named_modules(memo, prefix, remove_duplicate):
            if not name.endswith("1"):
                yield name, module


def _zoo() -> Iterator[tuple[str, nn.Module, list[Callable[[nn.Module], Any]]]]:
    """Modules, each with the changes made to it between reads."""
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.BatchNorm1d(3))
    yield (
        "sequential",
        seq,
        [
            lambda m: m.eval(),
            lambda m: m[0].register_forward_hook(lambda mod, i, o: o),
            lambda m: m[1].register_forward_pre_hook(lambda mod, i: None),
            lambda m: m[2].register_full_backward_hook(lambda mod, gi, go: None),
            lambda m: m[3].register_full_backward_pre_hook(lambda mod, go: None),
            lambda m: m[0]._forward_hooks.clear(),
            lambda m: setattr(m[0], "in_features", 4),
            lambda m: setattr(m[3], "running_mean", torch.ones(3)),
            lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(3, 3))),
            lambda m: m.__setitem__(1, nn.GELU()),
            lambda m: m.append(nn.Tanh()),
            lambda m: setattr(m[1], "approximate", "tanh"),
            lambda m: setattr(m[4], "new_attribute", 3),
            lambda m: delattr(m[4], "new_attribute"),
            lambda m: m.train(),
        ],
    )
    yield (
        "attributes",
        _Scaled(),
        [
            lambda m: setattr(m, "scale", 3.0),
            lambda m: setattr(m, "name", "other"),
            lambda m: m.config.__setitem__("eps", 1e-6),
            lambda m: m.config.__setitem__("table", torch.zeros(2)),
            lambda m: setattr(m, "count", torch.ones(())),
            lambda m: setattr(m, "pair", (torch.ones(3), 4)),
            lambda m: setattr(m, "shape", (3, 1e-6, None)),
            lambda m: setattr(m, "lin", nn.Linear(3, 3, bias=False)),
        ],
    )
    yield (
        "shared",
        _Shared(),
        [
            lambda m: setattr(m.b[0], "weight", nn.Parameter(torch.ones(3, 3))),
            lambda m: setattr(m, "empty", nn.Linear(3, 3)),
            lambda m: setattr(m.b, "2", m.b[0]),
        ],
    )
    yield (
        "own walk",
        _OwnWalk(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)),
        [lambda m: m.eval()],
    )
    yield (
        "nested own walk",
        nn.Sequential(nn.Linear(3, 3), _OwnWalk(nn.Linear(3, 3), nn.Tanh(), nn.ReLU())),
        [lambda m: m[1].eval()],
    )
    pytest.importorskip("transformers")
    import library_models

    yield (
        "gpt2",
        library_models.gpt2().model,
        [lambda m: m.eval(), lambda m: setattr(m.transformer.h[0].attn, "layer_idx", 7)],
    )


_ZOO = list(_zoo())


@pytest.mark.parametrize(("name", "model", "changes"), _ZOO, ids=[name for name, *_ in _ZOO])
def test_the_fast_read_keys_as_the_plain_loop(monkeypatch, name, model, changes):
    state = State(model)  # the traced module: its state collected apart
    holder = nn.Linear(2, 2)

    def reads() -> list[Callable[[], Environment]]:
        return [
            lambda: read_environment(state.roots),
            lambda: read_environment((), (("model", model),)),  # a module argument
            lambda: read_environment(State(lambda x: model(x) + holder(x)).roots),  # closed over
        ]

    for change in [lambda m: None, *changes]:
        change(model)
        for read in reads():
            _both(monkeypatch, read)


def _changes() -> Iterator[tuple[str, Callable[[nn.Sequential], Any], bool]]:
    """Each change, and whether it re-traces (a same-shaped tensor is a new input value, not a key)."""
    yield "eval", lambda m: m.eval(), True
    yield "forward hook", lambda m: m[0].register_forward_hook(lambda mod, i, o: o * 2), True
    yield "pre hook", lambda m: m[2].register_forward_pre_hook(lambda mod, i: (i[0] + 1,)), True
    yield "attribute", lambda m: setattr(m[1], "negative_slope", 0.5), True
    yield "buffer dtype", lambda m: setattr(m[3], "num_batches_tracked", torch.tensor(0.0)), True
    yield "buffer values", lambda m: setattr(m[3], "running_mean", torch.ones(3)), False
    yield "parameter shape", lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(3, 1))), True
    yield (
        "parameter values",
        lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(3, 3))),
        False,
    )
    yield "submodule", lambda m: m.__setitem__(1, nn.Tanh()), True
    yield "tied", lambda m: setattr(m[2], "weight", m[0].weight), True
    yield "new attribute", lambda m: setattr(m[2], "scale", 2.0), True


@pytest.mark.parametrize(
    ("name", "change", "retraces"), list(_changes()), ids=[n for n, *_ in _changes()]
)
def test_every_change_between_calls_retraces(name, change, retraces):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.1), nn.Linear(3, 3), nn.BatchNorm1d(3))
    compiled = aotgrad.aot_module(model)
    x = torch.randn(4, 3)
    compiled(x)
    compiled(x)
    assert aotgrad.cache_info(compiled).misses == 1
    change(model)
    if name == "parameter shape":
        model[0].in_features, x = 1, torch.randn(4, 1)
    eager = copy.deepcopy(model)
    torch.testing.assert_close(compiled(x), eager(x))
    assert aotgrad.cache_info(compiled).misses == 1 + retraces


def test_plain_attributes_are_keyed_without_asking_about_fsdp(monkeypatch):
    # Note [Reading a module, fast]: only a dict (``config``) can be FSDP2's bookkeeping, so
    # only a dict is asked; ``training``, ``in_features``, the float ``scale`` never are.
    asked: list[Any] = []

    def counting(value: Any) -> bool:
        asked.append(value)
        return is_fsdp_bookkeeping(value)

    monkeypatch.setattr(closures, "is_fsdp_bookkeeping", counting)
    model = _Scaled()
    read_environment(State(model).roots)
    assert asked == [model.config]


@pytest.mark.parametrize(
    "value",
    [
        (),
        (256,),
        (2, 3.5),
        (True, 1, -0.0, 0.0),
        (float("nan"), None, "a", b"b"),
        (1, (2,)),
        (1, [2]),
        (1, 2.5j),
        (1, torch.float32),
        (True, nn.Linear),
    ],
)
def test_a_flat_tuple_is_keyed_as_the_recursion_keys_it(value):
    assert values.value_key(value) == values._key(value, "", 0, set())
