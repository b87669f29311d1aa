"""The full tracer: the joint function under functionalization, inside ``make_fx``.

It handles everything capture handles: in-place ops and ``out=`` (turned into
values by functionalization), symbolic sizes, inputs that share memory,
reentrant checkpoints (Note [Reentrant checkpoints]). See Note [Two tracers].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx as fx
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.fx.experimental.proxy_tensor import make_fx

from aotgrad._torch_compat import (
    FunctionalTensor,
    enable_python_dispatcher,
    sync,
    use_lazy_graph_module,
)
from aotgrad.capture.analyses.backward_state import backward_mutations, mutation_counts
from aotgrad.capture.analyses.mutation import (
    InputMutation,
    PrimalInfo,
    analyze_mutations,
    check_restrided_data,
    with_kernel_resizes,
)
from aotgrad.capture.analyses.set_storage import resizes_watched
from aotgrad.capture.tracing.recorder import ProvenanceMode, Recorder
from aotgrad.capture.tracing.state import TraceState
from aotgrad.capture.tracing.tracers import FullTraceRefused, Tracer
from aotgrad.errors import UserFrame, format_error


def refuse_untraceable(
    primals: Sequence[torch.Tensor], descriptors: Sequence[object], where: UserFrame | None
) -> None:
    """Refuse a sparse input that requires grad: under functionalization its gradient is lost
    (``a.to_dense()``: None, where eager has one) or, compressed (``to_sparse_csr``), the
    process aborts (torch 2.13). The direct trace takes it (Note [The fast path as a layer])."""
    for p, desc in zip(primals, descriptors, strict=True):
        if p.layout is not torch.strided and p.requires_grad:
            raise FullTraceRefused(
                format_error(
                    f"input {desc} is a {p.layout} tensor that requires grad, which the full"
                    " trace (functionalization) cannot differentiate",
                    where,
                    "Pass it with requires_grad=False or as a dense tensor, or leave the fast"
                    " path on and tracer='auto' (its direct trace takes it).",
                )
            )


class FullTracer(Tracer):
    """Functionalization inside ``make_fx`` (Note [Two tracers]).

    ``symbolic``: the fakes have symbolic sizes (Note [Python dispatcher for
    symbolic sizes]); ``leaf_primals``: differentiate with ``.backward()``
    into leaf primals (Note [Reentrant checkpoints]).
    """

    name = "full"

    def __init__(
        self,
        recorder: Recorder,
        decompositions: Mapping[Any, Callable[..., Any]] | None,
        *,
        symbolic: bool,
        leaf_primals: bool,
    ) -> None:
        super().__init__(recorder, decompositions, leaf_primals=leaf_primals)
        self.symbolic = symbolic
        # Functionalization, noting each op's source line; one mode for the whole trace.
        self._mode = ProvenanceMode(recorder, note_real_leaves=leaf_primals)

    def run(
        self, joint: Callable[..., list[torch.Tensor | None]], fakes: Sequence[torch.Tensor]
    ) -> fx.GraphModule:
        # Note [Python dispatcher for symbolic sizes]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # With symbolic sizes, C++ composite kernels (``clamp_``'s functionalization,
        # ``constant_pad_nd``) read sizes as ints, which fails or specializes; the Python
        # dispatcher runs their symbolic-aware Python kernels instead, as
        # ``make_fx(tracing_mode="symbolic")`` does.
        dispatcher = enable_python_dispatcher() if self.symbolic else contextlib.nullcontext()
        # make_fx's graph module generates its code on first use (Note [Code on demand])
        sets = self._mode.storage_sets  # Note [Storage resizes of an input]
        watched, kept = resizes_watched(sets.resize), sets.real_versions_kept()
        with dispatcher, self.recorder.recording(), use_lazy_graph_module(True), watched, kept:
            return make_fx(
                joint,
                decomposition_table=self.decompositions,
                _disable_torch_fn_metadata_mode=True,
            )(*fakes)

    def dispatch_mode(self) -> AbstractContextManager[Any]:
        return self._mode

    def graph_primals(
        self, fakes: Sequence[torch.Tensor], infos: Sequence[PrimalInfo]
    ) -> list[torch.Tensor]:
        """One functional wrapper per distinct input; a repeated input gets the same wrapper.

        The wrappers are not leaves (in-place ops on non-leaf inputs are legal),
        unless ``leaf_primals`` asks for autograd leaves that accumulate ``.grad``.
        """
        primals: list[torch.Tensor] = []
        for p, info in zip(fakes, infos, strict=True):
            if info.duplicate_of is not None:
                primals.append(primals[info.duplicate_of])
                continue
            wrapped: torch.Tensor = FunctionalTensor.to_functional(p)
            if self.leaf_primals:
                wrapped = wrapped.detach().requires_grad_(p.requires_grad)
            primals.append(wrapped)
        firsts = [p for p, info in zip(primals, infos, strict=True) if info.duplicate_of is None]
        leaves = [i.is_leaf and i.requires_grad for i in infos if i.duplicate_of is None]
        self._mode.storage_sets.note_inputs(firsts, leaves)  # Note [set_() on an input]
        return primals

    def differentiate_at(self, primal: torch.Tensor) -> GradientEdge | torch.Tensor | None:
        """The wrapper's gradient edge: an in-place op may replace the wrapper (Note [Input mutation]).

        With leaf primals, nothing: ``.backward()`` accumulates into their ``.grad``.
        """
        return None if not primal.requires_grad or self.leaf_primals else get_gradient_edge(primal)

    def traced(self, value: object) -> bool:
        return isinstance(value, FunctionalTensor)

    def input_mutations(self, state: TraceState) -> list[InputMutation]:
        primals, descriptors, where = state.graph_primals, state.inputs.descriptors, state.where
        sets, sites = self._mode.storage_sets, self.recorder.mutation_sites
        storages = sets.new_storages(primals, state.fakes)
        infos, resized = state.inputs.infos, sets.resized
        mutations = analyze_mutations(
            primals, state.grad_fns, infos, descriptors, where, sites, storages, resized
        )
        mutations = with_kernel_resizes(mutations, primals)
        check_restrided_data(mutations, state.fakes, descriptors, where)
        return mutations

    def sync(self, values: Sequence[torch.Tensor]) -> None:
        """Apply pending in-place updates, so they are recorded as forward ops."""
        for value in values:
            sync(value)

    @contextlib.contextmanager
    def backward_checked(self, state: TraceState) -> Iterator[list[int]]:
        """Note [State updated by the backward]."""
        primals = state.graph_primals
        before = mutation_counts(primals)
        changed: list[int] = []
        yield changed
        sites = self.recorder.backward_sites
        changed += backward_mutations(primals, before, state.inputs.descriptors, state.where, sites)

    def unwrap(self, value: torch.Tensor | None) -> torch.Tensor | None:
        return value.from_functional() if isinstance(value, FunctionalTensor) else value


__all__ = ["FullTracer"]
