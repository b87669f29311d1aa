"""DDP and FSDP2 around aotgrad's graphs: the wrapper's own forward logic runs eagerly on every
call, and the module it wraps is what aotgrad captures (Note [Wrappers run around the graphs])."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.utils._pytree as pytree

from aotgrad import _torch_compat as compat
from aotgrad.errors import UnsupportedWrapperError

# Note [Wrappers run around the graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DDP and FSDP2 do their work in Python around the module they wrap, on every call: DDP's
# forward prepares its reducer for the coming backward (without it, the gradient hooks of the
# next backward do not all-reduce), FSDP2's forward hooks all-gather each unit's parameters,
# reshard them after, and register the hooks that all-gather again and reduce-scatter the
# gradients in the backward. A graph captured through them would hold one call's worth of that
# logic, run once at capture, and train unsynchronized from then on. So aotgrad captures the
# module inside and runs the wrapper's logic eagerly around the graphs, on every call::
#
#     model = aotgrad.aot_module(DDP(net))   # captures net, parameters named module.fc.weight
#     model(x)   ->  ddp._pre_forward(x)      # reducer.prepare_for_forward, buffer broadcast
#                    graphs(params, x)        # the compiled forward (backward: autograd.Function)
#                    ddp._post_forward(out)   # reducer.prepare_for_backward
#     loss.backward()  ->  the compiled backward writes each param.grad through its
#                          AccumulateGrad node, whose hook is DDP's: buckets all-reduce as in eager
#
#     model = aotgrad.aot_module(fully_shard(net))   # with fully_shard(net[0]) before
#     model(x)   ->  root pre-forward (lazy init, all-gather root), net[0] pre-forward (all-gather;
#                    on CPU, started with the other units': Note [All-gathers in flight together])
#                    graphs(unsharded params, x)   # unit hooks inside paused: params are plain
#                    net[0] post-forward, root post-forward   # reshard, pre-backward hooks on out
#     loss.backward()  ->  pre-backward hooks (all-gather again), compiled backward (grads of
#                          the unsharded params), FSDP's final callback (reduce-scatter)
#
# FSDP2 runs every unit's hooks around the one graph pair, where eager runs them around each
# unit: the same collectives in the same order on every rank, the same values, but all units
# are unsharded at once during the forward and the backward (peak memory of the whole model's
# parameters, as with one unit). Configurations whose logic would need running between ops of
# the graph (DDP's find_unused_parameters, FSDP2's mixed precision casts of inputs and
# outputs, grouped units) are refused with what to use instead.

_COMPILE_INSTEAD = 'torch.compile(model, backend="aotgrad") supports it (it splits the graph)'
_COMPILE_TRY = 'torch.compile(model, backend="aotgrad")'


class Wrapping(Protocol):
    """A wrapper (DDP, an FSDP2 root) whose logic runs around the captured ``inner`` module."""

    @property
    def inner(self) -> torch.nn.Module:
        """The module aotgrad captures: its parameters are the graphs' ``Param`` inputs."""
        ...

    def call(self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The wrapper's forward, with ``run`` (the graphs) in place of the wrapped module."""
        ...

    def capturing(self) -> contextlib.AbstractContextManager[None]:
        """The module state as ``run`` sees it, for a capture outside ``call`` (``trace``)."""
        ...


class _Inner(torch.nn.Module):
    """The module DDP wraps, under DDP's name for it: parameters keep DDP's names, and the
    arguments the wrapped module's ``forward`` names.

    >>> inner = _Inner(torch.nn.Linear(2, 2))
    >>> [name for name, _ in inner.named_parameters()], str(inspect.signature(inner.forward))
    (['module.weight', 'module.bias'], '(input: torch.Tensor) -> torch.Tensor')
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.module(*args, **kwargs)

        with contextlib.suppress(TypeError, ValueError):  # without one: named args[i]
            forward.__signature__ = inspect.signature(module.forward)  # type: ignore[attr-defined]
        self.forward = forward


@dataclass(frozen=True, kw_only=True)
class DDPWrapping:
    """DDP's pre- and post-forward around the graphs of the module it wraps."""

    ddp: torch.nn.Module
    inner: torch.nn.Module

    def call(self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            args, kwargs = compat.ddp_pre_forward(self.ddp, args, kwargs)
            return compat.ddp_post_forward(self.ddp, run(*args, **kwargs))

    def capturing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class FSDPWrapping:
    """Every FSDP2 unit's forward hooks around the graphs of the root (unit hooks paused inside)."""

    inner: torch.nn.Module

    def call(self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        root = compat.fsdp_state(self.inner)
        # Every unit's all-gather in flight at once, the root's too, each waited for by its
        # own pre-forward (Note [All-gathers in flight together]); before the root's first
        # pre-forward (its lazy init) no unit is known, and they start right after it.
        compat.fsdp_start_all_gathers(compat.fsdp_all_states(root), backward=False)
        args, kwargs = compat.fsdp_pre_forward(root, self.inner, args, kwargs)
        units = [state for state in compat.fsdp_all_states(root) if state is not root]
        compat.fsdp_start_all_gathers(units, backward=False)
        for state in units:
            compat.fsdp_pre_forward(state, compat.fsdp_state_modules(state)[0], (), {})
        with _hooks_paused([root, *units]):
            output = run(*args, **kwargs)
        for state in reversed(units):
            output = compat.fsdp_post_forward(state, compat.fsdp_state_modules(state)[0], output)
        output = compat.fsdp_post_forward(root, self.inner, output)
        _all_gathers_first_in_backward(output, [root, *units])
        return output

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        units = _fsdp_units(self.inner)
        for _, module in units:
            cast(Any, module).unshard()  # FSDPModule's public all-gather
        try:
            with _hooks_paused([compat.fsdp_state(m) for _, m in units]):
                yield
        finally:
            for _, module in reversed(units):
                cast(Any, module).reshard()


# Note [All-gathers in flight together]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager FSDP2 all-gathers one unit at a time: a unit's pre-forward hook starts its
# all-gather and waits for it before the unit runs (on CPU there is no side stream to
# overlap it with, so every all-gather is a round trip that nothing else overlaps).
# aotgrad runs every unit's hooks around one graph (Note [Wrappers run around the graphs]),
# so it knows all of them are needed before anything runs, and starts them all first::
#
#     eager FSDP2 (4 units)             aotgrad
#     forward:  root: gather, wait      start gathers root 0 1 2 3 (as FSDPModule.unshard(async_op=True))
#               gather 0, wait          root, unit 0..3 pre-forward: each waits for its own gather
#               unit 0 runs             graphs(params, x)
#               gather 1, wait ...
#     backward: unit 3's hook: gather 3,    first hook on the output: start gathers 3 2 1 0
#               wait; unit 3's grads        unit 3..0 pre-backward: each waits for its own
#               unit 2's hook: gather 2 ... backward graph
#
# The same collectives, in the same order on every rank, with the same values: only the
# waits move. Peak memory does not change (aotgrad holds every unit unsharded during the
# graphs anyway). In the backward the starting hook goes in front of FSDP's pre-backward
# hooks on each output tensor, and starts only the units whose hook is on that tensor and
# will wait for the gather right after: an all-gather nobody waited for would be copied
# out by the next forward's hook, with the parameters from before the optimizer step.
# Groups FSDP is busy with, or does not unshard in the backward, are left to FSDP, and so
# are groups on a GPU: there FSDP gathers on side streams that already leave the CPU free,
# ordered after the optimizer step (``set_post_optim_event`` too), which an ``async_op``
# gather on the current stream would not be.


def _all_gathers_first_in_backward(output: Any, states: list[Any]) -> None:
    """Before FSDP's pre-backward hooks on each output tensor: one hook that starts the
    all-gathers they will wait for (Note [All-gathers in flight together])."""
    if not torch.is_grad_enabled():
        return
    for t in pytree.tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            hooked = compat.fsdp_pre_backward_hooked(t, states)
            if hooked:
                compat.prepend_tensor_hook(t, functools.partial(_start_all_gathers, hooked))


def _start_all_gathers(states: list[Any], grad: torch.Tensor) -> None:
    if not torch.compiler.is_compiling():  # compiled autograd: FSDP's own hooks, as traced
        compat.fsdp_start_all_gathers(states, backward=True)


@contextlib.contextmanager
def _hooks_paused(states: list[Any]) -> Iterator[None]:
    before = compat.fsdp_pause_hooks(states)
    try:
        yield
    finally:
        compat.fsdp_resume_hooks(states, before)


def wrapping_of(module: torch.nn.Module) -> Wrapping | None:
    """How to run ``module`` when it is a DDP or FSDP2 wrapper; None for other modules.

    Raises ``UnsupportedWrapperError`` for wrappers aotgrad cannot run faithfully.

    >>> wrapping_of(torch.nn.Linear(2, 2)) is None
    True
    """
    ddp_type = torch.nn.parallel.DistributedDataParallel
    if isinstance(module, ddp_type):
        _check_ddp(module)
        _check_no_wrappers_inside(module.module, "module.", "DDP")
        return DDPWrapping(ddp=module, inner=_Inner(module.module))
    units = _fsdp_units(module)
    if units and units[0][0] == "":
        _check_fsdp(units)
        return FSDPWrapping(inner=module)
    _check_no_wrappers_inside(module, "", type(module).__name__)
    return None


def _check_ddp(ddp: Any) -> None:
    if ddp.find_unused_parameters:
        raise UnsupportedWrapperError(
            "aotgrad cannot run DDP(find_unused_parameters=True): DDP finds the unused"
            " parameters by walking the autograd graph of each output, and aotgrad's compiled"
            " function reaches every parameter, so the reducer would wait for gradients that"
            " never come. Construct DDP with find_unused_parameters=False when every parameter is"
            f" used, or {_COMPILE_INSTEAD}."
        )
    for mode, used in compat.ddp_modes(ddp).items():
        if used:
            raise UnsupportedWrapperError(
                f"aotgrad cannot run DDP with {mode}: its forward works differently from the"
                " pre-forward / module / post-forward that aotgrad runs around its graphs"
                f" (Note [Wrappers run around the graphs]). Use plain DDP, or try {_COMPILE_TRY}."
            )


def _fsdp_units(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The ``fully_shard`` modules in ``module`` (itself first when it is one), by path."""
    if "torch.distributed.fsdp" not in sys.modules:  # nothing was sharded in this process
        return []
    return [(n, m) for n, m in module.named_modules() if compat.fsdp_state(m) is not None]


def _check_fsdp(units: list[tuple[str, torch.nn.Module]]) -> None:
    for path, module in units:
        state = compat.fsdp_state(module)
        where = f"the fully_shard module {repr(path) if path else 'at the root'} ({type(module).__name__})"
        if len(compat.fsdp_state_modules(state)) > 1:
            raise UnsupportedWrapperError(
                f"aotgrad cannot run {where}: it was sharded with others in one grouped"
                " fully_shard([...]) call, whose hooks run per module. Call fully_shard on"
                f" each module, or {_COMPILE_INSTEAD}."
            )
        policy = compat.fsdp_mixed_precision(state)
        if policy.param_dtype is not None or policy.output_dtype is not None:
            raise UnsupportedWrapperError(
                f"aotgrad cannot run {where} with MixedPrecisionPolicy(param_dtype="
                f"{policy.param_dtype}, output_dtype={policy.output_dtype}): its casts of each"
                " unit's inputs and outputs run between ops of aotgrad's one graph (Note"
                " [Wrappers run around the graphs]). Leave param_dtype and output_dtype unset"
                f" (reduce_dtype is fine), or {_COMPILE_INSTEAD}."
            )
        _check_no_wrappers_inside(module, f"{path}." if path else "", "fully_shard", ddp_only=True)


def _check_no_wrappers_inside(
    module: torch.nn.Module, prefix: str, outer: str, ddp_only: bool = False
) -> None:
    """Refuse a DDP or FSDP2 wrapper inside ``module``: aotgrad runs wrappers only at the root."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    fsdp = not ddp_only and "torch.distributed.fsdp" in sys.modules
    for path, sub in module.named_modules():
        is_ddp = isinstance(sub, ddp_type)
        is_fsdp = fsdp and compat.fsdp_state(sub) is not None
        if is_ddp or is_fsdp:
            kind = "DDP" if is_ddp else "fully_shard"
            raise UnsupportedWrapperError(
                f"aotgrad runs DDP and fully_shard only as the module it is given: {outer} holds"
                f" a {kind} module at {(prefix + path).rstrip('.')}, whose hooks would run inside the graph,"
                " once, at capture. Pass the wrapper itself (aotgrad.aot_module(DDP(model)), or"
                " fully_shard the root too: fully_shard(model.layer); fully_shard(model)), or"
                f" {_COMPILE_INSTEAD}."
            )


def refuse_reached_wrappers(reached: list[tuple[str, Any]]) -> None:
    """Refuse a DDP or FSDP2 module that a function reads (a closure, a global, an argument):
    aotgrad would trace through its hooks once, at capture.

    >>> refuse_reached_wrappers([("closure model", torch.nn.Linear(2, 2))])
    """
    for where, value in reached:
        if isinstance(value, torch.nn.Module):
            _check_no_wrappers_inside(value, f"{where}.", where)
