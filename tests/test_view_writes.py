"""Note [Writes through views, directly]: the direct trace scatters a write through a view into
its base, replays the base's other views on the new base, and gives the full trace's graphs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import aotgrad
from aotgrad.capture import node_info
from aotgrad.testing import verify

pytestmark = pytest.mark.fast_path  # Note [The fast path as a layer]

# view kind -> the view of a 4x4 tensor the function writes through
VIEWS = {
    "select": lambda h: h[1],
    "slice of rows": lambda h: h[1:3],
    "narrow": lambda h: h.narrow(0, 1, 2),
    "transpose": lambda h: h.transpose(0, 1),
    "t": lambda h: h.t(),
    "permute": lambda h: h.permute(1, 0),
    "view": lambda h: h.view(16),
    "reshape": lambda h: h.reshape(2, 8),
    "unsqueeze": lambda h: h.unsqueeze(0),
    "squeeze": lambda h: h.unsqueeze(0).squeeze(0),
    "as_strided": lambda h: h.as_strided((2, 4), (4, 1)),
    "alias": lambda h: torch.ops.aten.alias(h),
    "view of a view": lambda h: h.view(2, 8)[1],
}


def _write_then_read_base(view):
    def fn(x):
        h = x * 2
        view(h).add_(1)  # h changes too
        return h.sin()

    return fn


def _write_then_read_other_views(view):
    def fn(x):
        h = x * 2
        w, k = view(h), h[0]
        w.mul_(3)  # k and h change too
        return k * 2, w + 1, h.cos()

    return fn


def _write_base_then_read_views(view):
    def fn(x):
        h = x * 2
        w = view(h)
        h.mul_(3)  # w changes too
        return w * 2

    return fn


BODIES = {
    "write, read base": _write_then_read_base,
    "write, read other views": _write_then_read_other_views,
    "write base, read view": _write_base_then_read_views,
}


def _input_view_write(x, buf):
    buf[1:3].add_(x.detach())  # a buffer updated through a slice: an input mutation
    return (x * buf[1:3]).sum()


def _input_select_write(x, buf):
    buf.t()[0].copy_(x.detach()[0])
    return x * 2


def _permute_contiguous(x):
    h = (x * 2).permute(1, 0)
    c = h.contiguous()
    h[0].zero_()  # the contiguous copy keeps its values, h's base changes
    return c + h


class _WritesIntoAView(torch.autograd.Function):
    """A backward that copies the gradient into a view of a fresh buffer (as as_strided's does)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        buffer = grad.new_zeros(grad.shape[0] + 2, *grad.shape[1:])
        buffer[1:-1].copy_(grad * 3)
        return buffer[1:-1] + buffer[:2].sum()


def _backward_writes(x):
    return _WritesIntoAView.apply(x).sin()


def _pools_channels_last(x):
    # adaptive_avg_pool2d restrides its result (as_strided_); its backward writes into a view
    x = x.contiguous(memory_format=torch.channels_last).sin()
    return F.adaptive_avg_pool2d(x, 1).flatten(1)


def _cases():
    torch.manual_seed(0)
    x = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    cases = {
        f"{body}: {view}": (make(fn), (x(4, 4),))
        for body, make in BODIES.items()
        for view, fn in VIEWS.items()
    }
    cases.update(
        {
            "a buffer updated through a slice": (_input_view_write, (x(2, 4), torch.zeros(4, 4))),
            "an input updated through a view": (_input_select_write, (x(4), torch.zeros(4, 4))),
            "permute, contiguous, write": (_permute_contiguous, (x(3, 4),)),
            "backward writes into a view": (_backward_writes, (x(4, 3),)),
            "adaptive pool on channels_last": (_pools_channels_last, (x(2, 3, 4, 4),)),
        }
    )
    return cases


def _structure(gm: fx.GraphModule) -> list[tuple[object, ...]]:
    """Each node's op, target, arguments (by position), provenance and descriptor, no names.

    The full trace also records views it then drops, which take names, so names may
    differ where every kept node is the same (Note [Writes through views, directly]).
    """
    position = {n: f"%{i}" for i, n in enumerate(gm.graph.nodes)}

    def arg(a: object) -> object:
        return position[a] if isinstance(a, fx.Node) else a

    return [
        (
            n.op,
            str(n.target),
            str(fx.node.map_aggregate(n.args, arg)),
            str(fx.node.map_aggregate(n.kwargs, arg)),
            None if n.op == "output" else node_info(n),
            n.meta.get("desc"),
        )
        for n in gm.graph.nodes
    ]


def _ops(gm: fx.GraphModule) -> list[str]:
    """The graph's ops with their non-tensor arguments, in no order."""
    return sorted(
        f"{n.target}{[a for a in n.args if not isinstance(a, fx.Node)]}"
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


def _saved(traced: aotgrad.Traced) -> list[dict[str, object]]:
    """The saved values, without the node names in them."""
    unnamed = ("name", "users", "reason")
    return [{k: v for k, v in s.to_dict().items() if k not in unnamed} for s in traced.saved]


# Where autograd itself replays views in the backward (a view written through, then read),
# it does so only for the full trace's functional tensors (they have no as_strided), and
# functionalization then brings the base up to date at another op: the same ops, in
# another order or with another op's seq_nr (Note [Writes through views, directly]).
REORDERED = {"backward writes into a view", "adaptive pool on channels_last"}


@pytest.mark.parametrize("case", list(_cases()))
def test_direct_and_full_traces_give_the_same_graphs(case):
    fn, args = _cases()[case]
    direct = aotgrad.trace(fn, *args, tracer="direct")
    full = aotgrad.trace(fn, *args, tracer="full")
    assert aotgrad.trace(fn, *args).tracer == "direct"  # auto
    assert _structure(direct.forward) == _structure(full.forward)
    assert (direct.backward is None) == (full.backward is None)
    if full.backward is not None and case in REORDERED:
        assert _ops(direct.backward) == _ops(full.backward)
    elif full.backward is not None:
        assert _structure(direct.backward) == _structure(full.backward)
    assert str(direct.signature) == str(full.signature)
    assert _saved(direct) == _saved(full)


@pytest.mark.parametrize("case", list(_cases()))
def test_direct_trace_matches_eager(case):
    fn, args = _cases()[case]
    report = verify(fn, *args, compile_fn=lambda f: aotgrad.aot_function(f, tracer="direct"))
    assert report.compared_outputs >= 1 and report.compared_grads >= 1


def test_the_scatter_is_in_the_graph():
    def fn(x):
        h = x * 2
        h[1].add_(1)
        return h

    joint = aotgrad.trace(fn, torch.randn(4, 4), tracer="direct").joint
    targets = [n.target for n in joint.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert targets == [
        aten.mul.Tensor,
        aten.select.int,
        aten.add.Tensor,
        aten.select_scatter.default,
    ]


def test_a_buffer_written_through_a_view_is_an_input_mutation():
    buf = torch.zeros(4, 4)
    traced = aotgrad.trace(_input_view_write, torch.randn(2, 4, requires_grad=True), buf)
    assert traced.tracer == "direct"
    assert [str(d) for d in traced.signature.forward_outputs][:2] == ["output", "new value of buf"]


def test_convnext_takes_the_direct_trace():
    import library_models

    case = library_models.build("convnext")
    traced = aotgrad.trace(case.model, *case.args, **case.kwargs)
    assert (traced.tracer, traced.fallback_reason) == ("direct", None)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda x: x.split(2)[0].add_(1), "a write through a view made by aten.split.Tensor"),
        (lambda x: x.unfold(0, 2, 2).add_(1), "a write through a view made by aten.unfold"),
    ],
)
def test_writes_it_cannot_scatter_stop_the_direct_trace(fn, reason):
    traced = aotgrad.trace(lambda x: fn(x * 1), torch.randn(4, 4))
    assert traced.tracer == "full"
    assert reason in traced.fallback_reason
