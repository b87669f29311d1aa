"""One smoke test per private torch name in ``aotgrad._torch_compat``: it exists and behaves as
aotgrad assumes. After a torch upgrade, this file says which assumption broke."""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import pathlib
import sys
import threading
import traceback

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from aotgrad import _torch_compat as compat

aten = torch.ops.aten


def _defined_names() -> list[str]:
    """The names ``_torch_compat`` defines (assignments, functions, classes), not its imports."""
    tree = ast.parse(inspect.getsource(compat))
    names = []
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
    return [n for n in names if not n.startswith("_")]


def test_every_name_has_a_smoke_test():
    source = pathlib.Path(__file__).read_text()
    untested = [n for n in _defined_names() if f"compat.{n}" not in source]
    assert len(_defined_names()) > 40 and not untested, f"no smoke test uses {untested}"


# --- Operators ---------------------------------------------------------------------------------


def test_in_autograd_engine_is_true_only_inside_a_backward():
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen.append(compat.in_autograd_engine())
            return grad

    assert not compat.in_autograd_engine()
    Spy.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [True]


def test_op_overload_is_the_type_of_aten_ops():
    assert isinstance(aten.mm.default, compat.OpOverload)
    assert not isinstance(torch.mm, compat.OpOverload)


def test_op_kernel_computes_the_op():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    torch.testing.assert_close(compat.op_kernel(aten.mm.default)(a, b), a @ b)


# --- Fake tensors ------------------------------------------------------------------------------


def test_fake_mode_makes_fake_tensors():
    with compat.FakeTensorMode():
        t = torch.ones(2, 3)
    assert isinstance(t, compat.FakeTensor) and t.shape == (2, 3)


def test_fake_mode_raises_on_reading_values():
    with compat.FakeTensorMode():
        t = torch.ones(3)
        with pytest.raises(compat.DataDependentOutputException):
            t.sum().item()
        with pytest.raises(compat.DynamicOutputShapeException):
            t.nonzero()


def test_view_stride_is_eagers_or_none():
    assert list(compat.view_stride([2, 3], [3, 1], [6])) == [1]
    assert compat.view_stride([3, 2], [1, 3], [6]) is None  # a transpose cannot be viewed flat


def test_in_kernel_invocation_shows_fake_tensors_as_meta_tensors():
    mode = compat.FakeTensorMode()
    with mode:
        x = torch.empty(2, 3)
    with compat.in_kernel_invocation(mode):
        assert x.device.type == "meta"
        out = torch.ops.aten.mm.default(x, x.t())
    assert out.shape == (2, 2) and not isinstance(out, compat.FakeTensor)
    assert x.device.type == "cpu"


def test_fake_device_is_the_fake_modes_answer():
    mode = compat.FakeTensorMode()
    with mode:
        x = torch.empty(2)
    assert compat.fake_device(x) == x.device == torch.device("cpu")
    with compat.in_kernel_invocation(mode):
        assert compat.fake_device(x) == torch.device("meta")


def test_meta_kernels_and_the_fake_modes_own_rules_are_told_apart():
    aten = torch.ops.aten
    assert compat.has_meta_kernel(aten.mm.default)
    assert compat.fake_mode_has_own_rule(aten.view.default)  # a fake_impls rule
    assert compat.fake_mode_has_own_rule(aten.empty_strided.default)  # a constructor
    assert compat.fake_mode_has_own_rule(torch.ops.prim.device.default)  # a metadata query
    assert not compat.fake_mode_has_own_rule(aten.mm.default)
    assert compat.fake_mode_decomposes(aten.addmm.default)  # torch._decomp's decomposition
    assert compat.fake_mode_decomposes(aten.native_batch_norm.default)
    assert not compat.fake_mode_decomposes(aten.mm.default)  # a Python meta kernel
    assert not compat.fake_mode_decomposes(aten.permute.default)  # a torch._refs entry only


def test_traceable_wrapper_subclass_has_flatten_and_unflatten():
    from subclasses import TwoTensor

    t = TwoTensor(torch.ones(2), torch.zeros(2))
    assert compat.is_traceable_wrapper_subclass(t)
    assert not compat.is_traceable_wrapper_subclass(torch.nn.Parameter(torch.ones(2)))
    attrs, _ = t.__tensor_flatten__()
    assert attrs == ["a", "b"]


def test_device_mesh_is_an_opaque_reference():
    from torch.distributed.device_mesh import DeviceMesh

    assert not compat.is_opaque_reference(3) and not compat.is_opaque_reference(torch.ones(1))
    mesh = object.__new__(DeviceMesh)  # no process group needed to ask about the type
    # torch registers DeviceMesh as an opaque reference from 2.12 (Note [Behaviour by torch release])
    assert compat.is_opaque_reference(mesh) == (compat.TORCH_RELEASE >= (2, 12))


def test_asking_about_opaque_types_logs_nothing(caplog):
    """torch 2.14 deprecated the 2.11-2.13 names with two warning lines per call."""
    from torch.distributed.device_mesh import DeviceMesh

    with caplog.at_level(logging.WARNING):
        compat.is_opaque_reference(object.__new__(DeviceMesh))
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_the_running_torch_is_in_the_supported_window():
    oldest, newest = compat.SUPPORTED_RELEASES
    assert oldest <= compat.TORCH_RELEASE <= newest, torch.__version__
    # The suite verifies the fast path on every release of the window (README's matrix).
    assert all((2, minor) in compat.FAST_PATH_VERIFIED for minor in range(oldest[1], newest[1] + 1))


def test_no_dispatch_runs_below_the_fake_mode():
    with compat.FakeTensorMode(), compat.no_dispatch():
        t = torch.empty(2, device="meta")
    assert type(t) is torch.Tensor


def test_python_dispatcher_is_a_context_manager():
    with compat.enable_python_dispatcher():
        assert torch.ones(2).add(1).tolist() == [2.0, 2.0]


def test_the_fake_mode_logs_under_its_logger_name():
    assert compat.FAKE_TENSOR_LOGGER in logging.root.manager.loggerDict


# --- Functionalization -------------------------------------------------------------------------


def _functional(t: torch.Tensor) -> torch.Tensor:
    return compat.FunctionalTensor.to_functional(t)


def test_functional_mode_wraps_and_unwraps():
    x = torch.zeros(2)
    with compat.FunctionalTensorMode():
        y = _functional(x)
        y.add_(1)
        assert isinstance(y, compat.FunctionalTensor)
        compat.sync(y)
        inner = compat.from_functional_tensor(y.elem)
    assert type(inner) is torch.Tensor and inner.tolist() == [1.0, 1.0]
    assert compat.is_functional_tensor(y.elem) and not compat.is_functional_tensor(inner)


def test_mutation_probes_tell_data_metadata_and_storage_changes():
    real = [torch.zeros(2, 2) for _ in range(4)]
    new_storage = torch.ones(4)
    with compat.FunctionalTensorMode():
        data, meta, storage, untouched = map(_functional, real)
        before = compat.mutation_counter(data.elem)
        data.add_(1)
        meta.t_()
        storage.set_(_functional(new_storage))
        for t in (data, meta, storage, untouched):
            compat.sync(t)
        assert compat.mutation_counter(data.elem) == before + 1
        assert compat.has_data_mutation(data.elem) and not compat.has_data_mutation(meta.elem)
        assert compat.has_metadata_mutation(meta.elem)
        assert not compat.has_metadata_mutation(data.elem)
        assert compat.was_storage_changed(storage.elem)
        assert not compat.was_storage_changed(data.elem)
        assert not compat.has_data_mutation(untouched.elem)


def test_view_meta_sequence_replays_on_another_base():
    original, base = torch.zeros(3, 4), torch.zeros(3, 4)
    with compat.FunctionalTensorMode():
        view = _functional(base).t()[1:]
        chain = compat.view_meta_sequence(view.elem)
        with compat.disable_current_modes():
            replayed = compat.apply_view_meta_sequence(original, chain)
    expected = original.t()[1:]
    assert (replayed.shape, replayed.stride(), replayed.storage_offset()) == (
        expected.shape,
        expected.stride(),
        expected.storage_offset(),
    )


# --- Dispatch and torch-function modes ---------------------------------------------------------


class _Seen(compat.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_ops_unless_disabled():
    with _Seen() as seen:
        torch.ones(2).sin()
        with compat.disable_current_modes():
            torch.ones(2).cos()
    assert aten.sin.default in seen.ops and aten.cos.default not in seen.ops


def test_below_autograd_runs_ops_without_recording_them_for_autograd():
    x = torch.ones(2, requires_grad=True)
    with compat.below_autograd():
        y = x.sin()
    assert y.grad_fn is None and x.sin().grad_fn is not None


def test_autograd_would_have_decomposed_composite_ops_only():
    x = torch.ones(2, 3, requires_grad=True)
    w = torch.ones(4, 3, requires_grad=True)
    assert compat.autograd_would_have_decomposed(aten.linear.default, [x, w])
    assert not compat.autograd_would_have_decomposed(aten.mm.default, [x, w.t()])


def test_disable_torch_function_hides_calls_from_torch_function_modes():
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode(), compat.DisableTorchFunction():
        torch.ones(2).sin()
    assert torch.Tensor.sin not in seen


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_checkpoint_modes_are_what_its_contexts_make():
    forward, recompute = create_selective_checkpoint_contexts(_recompute_all)
    assert isinstance(forward, compat.SELECTIVE_CHECKPOINT_MODES)
    assert isinstance(recompute, compat.SELECTIVE_CHECKPOINT_MODES)


class _Asks(compat.TorchDispatchMode):
    """Notes, per op, whether a selective checkpoint's mode dispatched it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[object, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, compat.dispatched_by_selective_checkpoint(sys._getframe(1))))
        return func(*args, **(kwargs or {}))


def test_ops_a_selective_checkpoint_dispatches_are_told_apart():
    context = functools.partial(create_selective_checkpoint_contexts, _recompute_all)
    x = torch.ones(3, requires_grad=True)
    with _Asks() as asks:
        y = x.cos()
        z = checkpoint(torch.tanh, y, use_reentrant=False, context_fn=context)
        plain = checkpoint(torch.exp, y, use_reentrant=False)
        torch.autograd.grad((z + plain).sum(), x)
    by_op: dict[object, set[bool]] = {}
    for op, dispatched in asks.ops:
        by_op.setdefault(op, set()).add(dispatched)
    assert by_op[aten.tanh.default] == {True}  # in the forward and in the recompute
    assert by_op[aten.cos.default] == by_op[aten.exp.default] == {False}


# --- torch.fx internals ------------------------------------------------------------------------


def test_function_modes_lists_this_threads_torch_function_modes():
    class Mode(torch.overrides.TorchFunctionMode):
        pass

    with Mode() as mode:
        assert compat.function_modes()[-1] is mode
        assert compat.function_mode_count() == len(compat.function_modes()) >= 1
        seen = []
        thread = threading.Thread(target=lambda: seen.append(compat.function_modes()))
        thread.start()
        thread.join(10)
        assert seen == [[]]  # another thread's stack
    assert mode not in compat.function_modes()


def test_compiler_disabled_is_a_graph_break_under_dynamo_and_a_plain_call_outside():
    calls = []

    @compat.compiler_disabled
    def opaque(x):
        calls.append(torch.compiler.is_compiling())
        return x.sin()

    assert torch.equal(opaque(torch.ones(2)), torch.ones(2).sin())
    from torch._dynamo.testing import CompileCounter

    counts = CompileCounter()
    compiled = torch.compile(lambda x: opaque(x * 2) + 1, backend=counts)
    assert torch.equal(compiled(torch.ones(2)), (torch.ones(2) * 2).sin() + 1)
    # Dynamo broke the graph around ``opaque`` (two graphs) and ran it eagerly, not traced.
    assert counts.frame_count == 2 and calls == [False, False]


def test_dynamo_compiled_functions_finds_the_backends_callables_through_a_graph_break():
    import torch._dynamo

    class Breaks(torch.nn.Module):
        def forward(self, x):
            x = x.sin()
            torch._dynamo.graph_break()
            return x.cos()

    made = []

    def backend(gm, example_inputs):
        made.append(lambda *args: gm(*args))
        return made[-1]

    model = torch.compile(Breaks(), backend=backend)
    assert compat.dynamo_compiled_functions(model) == []
    model(torch.ones(2))
    assert compat.dynamo_compiled_functions(model) == made and len(made) == 2
    function = torch.compile(lambda x: x.tan(), backend=backend)
    function(torch.ones(2))
    assert compat.dynamo_compiled_functions(function) == [made[-1]]
    assert compat.dynamo_compiled_functions(Breaks()) is None


def test_dynamo_compile_lock_is_held_while_dynamo_compiles():
    import torch._dynamo  # loads the lock

    held = []

    def backend(gm, example_inputs):
        lock = compat.dynamo_compile_lock()
        held.append(lock.acquire(blocking=False))  # re-entrant: this thread holds it
        lock.release()

        def probe_lock() -> None:
            got = lock.acquire(blocking=False)
            held.append(got)
            if got:
                lock.release()

        probe = threading.Thread(target=probe_lock)
        probe.start()
        probe.join(10)
        return gm

    torch.compile(lambda x: x.sin(), backend=backend)(torch.ones(2))
    assert held == [True, False]


def test_copy_meta_fields_name_the_metadata_make_fx_copies():
    assert {"nn_module_stack", "custom", "original_aten"} <= set(compat.COPY_META_FIELDS)


def test_seq_nr_of_is_the_last_autograd_node_number():
    x = torch.ones(2, requires_grad=True)
    y = x.sin()
    assert compat.seq_nr_of("sin") == compat.autograd_node_number(y.grad_fn)


def test_tensor_metadata_describes_a_tensor():
    meta = compat.tensor_metadata(torch.ones(2, 3))
    assert meta.shape == (2, 3) and meta.dtype == torch.float32 and meta.stride == (3, 1)


def test_lazy_graph_modules_generate_code_on_first_use():
    with compat.use_lazy_graph_module(True):
        gm = make_fx(torch.sin)(torch.ones(2))
    assert isinstance(gm, compat.LazyGraphModule)
    assert "sin" in gm.code


def test_op_node_names_and_renaming():
    graph = fx.Graph()
    x = graph.placeholder("x")
    assert compat.op_node_name(graph, "LayerNorm") == "layer_norm"
    graph.create_node("call_function", aten.sin.default, (x,), name="sin")
    compat.rename_node(x, "sin")  # made unique among the graph's names
    assert x.name == "sin_1"


def test_expanded_code_gen_prints_descriptors():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["desc"] = "carry['a']"
    graph.output((x,))
    graph.set_codegen(compat.ExpandedCodeGen())
    assert "x,  # carry['a']" in fx.GraphModule({}, graph).code


# --- Autograd internals ------------------------------------------------------------------------


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_function_base_apply_runs_a_function_without_its_python_layer():
    apply = compat.FUNCTION_BASE_APPLY.__get__(None, _Double)
    x = torch.ones(2, requires_grad=True)
    apply(compat.unwrap_if_dead(x)).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]


def test_functorch_transforms_active_only_inside_a_transform():
    inside = []
    torch.func.vmap(lambda t: inside.append(compat.functorch_transforms_active()) or t)(
        torch.ones(2)
    )
    assert inside == [True] and not compat.functorch_transforms_active()


def test_peek_functorch_interpreter_names_the_innermost_transform():
    keys = []
    torch.func.grad(
        lambda t: keys.append(compat.peek_functorch_interpreter().key().name) or t.sum()
    )(torch.ones(2))
    torch.func.vmap(lambda t: keys.append(compat.peek_functorch_interpreter().key().name) or t)(
        torch.ones(2)
    )
    assert keys == ["Grad", "Vmap"]


def test_forward_ad_level_is_the_open_dual_level():
    assert compat.forward_ad_level() == -1
    assert not compat.functorch_or_forward_ad_active()
    with torch.autograd.forward_ad.dual_level():
        assert compat.forward_ad_level() == 0
        assert compat.functorch_or_forward_ad_active()
    assert compat.forward_ad_level() == -1
    inside = []
    torch.func.vmap(lambda t: inside.append(compat.functorch_or_forward_ad_active()) or t)(
        torch.ones(2)
    )
    assert inside == [True]


def test_set_version_counter_puts_the_version_back():
    x = torch.ones(2)
    version = x._version
    x.add_(1)
    compat.set_version_counter((x,), (version,))
    assert x._version == version


def test_view_creation_names_multi_output_views_and_set_view_creation_gives_their_rule():
    x = torch.ones(2, 3, requires_grad=True) * 1
    assert compat.view_creation(x.unbind(0)[1]) == "MULTI_OUTPUT_NODE"
    assert compat.view_creation(x.view(-1)) == "DEFAULT"
    with torch.no_grad():
        assert compat.view_creation(x.view(-1)) == "NO_GRAD_MODE"
    v = x.as_strided((3,), (1,), 3)
    compat.set_view_creation(v, "MULTI_OUTPUT_NODE")
    assert compat.view_creation(v) == "MULTI_OUTPUT_NODE"
    with pytest.raises(RuntimeError, match="returns multiple views"):
        v.mul_(2)


def test_custom_function_class_is_the_function_of_a_backward_node():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.ones(2, requires_grad=True)
    assert compat.custom_function_class(Double.apply(x).grad_fn) is Double
    assert compat.custom_function_class(x.sin().grad_fn) is None


def test_autograd_node_numbers_grow():
    x = torch.ones(2, requires_grad=True)
    a, b = x.sin(), x.cos()
    assert compat.autograd_node_number(b.grad_fn) > compat.autograd_node_number(a.grad_fn)


def test_compiling_flag_is_what_is_compiling_answers():
    was = compat.compiling_flag()
    compat.set_compiling_flag(True)
    try:
        assert torch.compiler.is_compiling()
    finally:
        compat.set_compiling_flag(was)
    assert not torch.compiler.is_compiling()


# --- Autocast ----------------------------------------------------------------------------------


def test_autocast_probes():
    assert not compat.any_autocast_enabled()
    with torch.autocast("cpu"):
        assert compat.any_autocast_enabled()
    assert "cpu" in compat.autocast_supported_devices()


# --- Guards, Dynamo and Inductor ---------------------------------------------------------------


def test_tensor_guards_check_metadata():
    x = torch.ones(2, 3)
    guards = compat.TensorGuards(x, dynamic_dims_sizes=[[2, 3]], dynamic_dims_strides=[[3, 1]])
    assert guards.check(torch.zeros(2, 3))
    assert not guards.check(torch.zeros(2, 3, dtype=torch.float64))
    assert not guards.check(torch.zeros(3, 2))


def test_local_source_renders_as_a_local():
    name = compat.local_source("t0").name
    assert (name() if callable(name) else name) == "L['t0']"


def test_dynamo_writes_example_values_and_graph_args():
    seen = []

    def backend(gm, example_inputs):
        (x,) = (n for n in gm.graph.nodes if n.op == "placeholder")
        name = x.meta[compat.DYNAMO_GRAPH_ARG].source.name  # Dynamo drops it after compiling
        seen.append((x.meta[compat.DYNAMO_EXAMPLE_VALUE], name() if callable(name) else name))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x.sin(), backend=backend)(torch.ones(2))
    ((value, name),) = seen
    assert isinstance(value, torch.Tensor) and name == "L['x']"


def test_dynamo_writes_regions_as_the_calls_aotgrad_unwinds():
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(x):
        with torch.no_grad(), torch.autocast("cpu"):
            y = x.sin()
        with torch.inference_mode():
            z = x.cos()
        return y, z

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(torch.ones(2))
    assert compat.DYNAMO_SET_GRAD_ENABLED in targets
    assert all(t in targets for t in (*compat.DYNAMO_ENTERS, *compat.DYNAMO_EXITS))


def test_inductor_compiles_a_decomposed_graph():
    decompositions = compat.inductor_decompositions()
    assert aten.threshold_backward.default in decompositions  # aotgrad's graphs keep it
    x = torch.randn(4)
    fake_mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    gm = make_fx(lambda t: (t.sin() + 1,), decomposition_table=decompositions)(x)
    with torch.no_grad():
        compiled = compat.inductor_compile(gm, [x], fake_mode)
    (out,) = compiled([x]) if compat.is_boxed(compiled) else compiled(x)
    torch.testing.assert_close(out, x.sin() + 1)


# --- Module hooks and pytree internals ---------------------------------------------------------


def test_global_module_hooks_hold_registered_hooks():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert handle.id in compat.global_module_hooks("_forward_hooks")
    finally:
        handle.remove()
    assert handle.id not in compat.global_module_hooks("_forward_hooks")


def test_module_hooks_are_the_hook_dicts_of_a_module_and_of_every_module():
    module = torch.nn.Linear(1, 1)
    for kind in compat.MODULE_HOOKS:
        assert isinstance(vars(module)[kind], dict)
        assert isinstance(compat.global_module_hooks(kind), dict)
    handle = module.register_forward_pre_hook(lambda *a: None)
    assert [k for k in compat.MODULE_HOOKS if vars(module)[k]] == ["_forward_pre_hooks"]
    handle.remove()


def test_pytree_node_type_of_a_namedtuple():
    from collections import namedtuple

    point = namedtuple("point", "x y")(1, 2)
    assert compat.pytree_node_type([1]) is list
    assert compat.pytree_node_type(point) is not type(point)  # all namedtuples flatten as one


# --- Error messages and names ------------------------------------------------------------------

_global = torch.ones(2)


def test_mutating_a_real_tensor_with_a_functional_one_says_so():
    with pytest.raises(RuntimeError) as info:
        torch.func.functionalize(lambda x: _global.add_(x))(torch.ones(2))
    assert compat.NON_FUNCTIONAL_MUTATION in str(info.value)
    assert compat.INTERNAL_ASSERT in str(info.value)


def test_reading_fake_data_below_the_mode_says_not_allocated():
    with compat.FakeTensorMode():
        t = torch.ones(2)
    with compat.no_dispatch(), pytest.raises(RuntimeError) as info:
        t.tolist()
    assert compat.DATA_NOT_ALLOCATED in str(info.value)


def test_an_effectful_op_without_a_token_names_the_op_last():
    with pytest.raises(AssertionError) as info, compat.FunctionalTensorMode():
        aten._print.default("hi")
    assert compat.EFFECT_TOKEN_MISSING in str(info.value)
    assert compat.effect_token_op(str(info.value)) == "aten._print.default"


def test_a_reentrant_checkpoint_refuses_grad():
    x = torch.ones(2, requires_grad=True)
    y = checkpoint(torch.sin, x, use_reentrant=True)
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad(y.sum(), x)
    assert compat.REENTRANT_CHECKPOINT_GRAD in str(info.value)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("failed in the backward")


def test_torch_function_names_as_tracebacks_name_them():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        _FailingBackward.apply(x).sum().backward()
    frames = [frame for frame, _ in traceback.walk_tb(info.value.__traceback__)]
    names = [f"{f.f_globals['__name__']}.{f.f_code.co_name}" for f in frames]
    assert names.count(compat.TENSOR_BACKWARD) == names.count(compat.ENGINE_RUN_BACKWARD) == 1
    assert compat.traceback_name(test_torch_function_names_as_tracebacks_name_them) == (
        f"{__name__}.test_torch_function_names_as_tracebacks_name_them"
    )


def test_engine_run_backward_computes_gradients():
    x = torch.ones(2, requires_grad=True)
    (grad,) = compat.engine_run_backward(
        (x.sin(),),
        (torch.ones(2),),
        False,
        False,
        (x,),
        allow_unreachable=True,
        accumulate_grad=False,
    )
    torch.testing.assert_close(grad, x.detach().cos())
    assert x.grad is None


# --- Compiled functions ------------------------------------------------------------------------


def test_boxed_functions_are_marked():
    def f(args):
        return args

    assert not compat.is_boxed(f)
    compat.mark_boxed(f)
    assert compat.is_boxed(f) and getattr(f, compat.BOXED_CALL)


# --- The rule ----------------------------------------------------------------------------------

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "aotgrad"
PUBLIC_AS_USED = "torch.utils._pytree"  # see the module docstring of _torch_compat


def _private_torch_paths(tree: ast.AST) -> list[str]:
    """``torch`` module paths and ``torch.x`` chains with a ``_``-prefixed part (``torch._C``,
    ``from torch.fx.proxy import _get_seq_nr``), aten op names and dunders aside."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch")]
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Del):
            parts = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch":
                found.append(".".join(["torch", *reversed(parts)]))
    return [p for p in found if _is_private(p)]


def _is_private(path: str) -> bool:
    if path == PUBLIC_AS_USED or path.startswith(PUBLIC_AS_USED + "."):
        return False
    parts = path.split(".")
    if "ops" in parts:  # torch.ops.aten._unsafe_view: an operator's name, not Python's
        parts = parts[: parts.index("ops")]
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def test_no_private_torch_names_outside_this_module():
    offenders = {}
    for path in SRC.rglob("*.py"):
        if path.name == "_torch_compat.py":
            continue
        private = _private_torch_paths(ast.parse(path.read_text()))
        if private:
            offenders[str(path.relative_to(SRC))] = private
    assert not offenders, f"use aotgrad._torch_compat instead: {offenders}"


def test_the_rule_catches_a_planted_violation():
    planted = "import torch._C\nfrom torch.fx.proxy import _get_seq_nr\nx = torch._sync\n"
    assert _private_torch_paths(ast.parse(planted)) == [
        "torch._C",
        "torch.fx.proxy._get_seq_nr",
        "torch._sync",
    ]
    public = "import torch.utils._pytree as pytree\ny = torch.ops.aten._unsafe_view.default\n"
    assert _private_torch_paths(ast.parse(public)) == []


def test_saved_tensors_hooks_stack_can_be_taken_off_and_put_back():
    pack, unpack = (lambda t: t), (lambda t: t)
    assert compat.top_saved_tensors_hooks(True) is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert compat.top_saved_tensors_hooks(True) == (pack, unpack)
        compat.pop_saved_tensors_hooks()
        assert compat.top_saved_tensors_hooks(True) is None
        compat.push_saved_tensors_hooks(pack, unpack)
    assert compat.top_saved_tensors_hooks(True) is None


def test_process_group_by_name_store_and_the_no_autograd_kernel_warning():
    import warnings

    import torch.distributed._functional_collectives as fc

    from multiproc import one_rank_group

    with one_rank_group() as world:
        assert compat.resolve_process_group(world.group_name) is world
        store = compat.default_store()
        store.set("aotgrad/smoke", "1")
        assert store.get("aotgrad/smoke") == b"1"
        w = torch.ones(2, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fc.broadcast(w * 2, 0, world).sum().backward()  # broadcast has no autograd kernel
        messages = [str(c.message) for c in caught]
        assert any(
            m.startswith("_c10d_functional::broadcast: ") and compat.NO_AUTOGRAD_KERNEL in m
            for m in messages
        ), messages


# --- Distributed wrappers (one spawn of 2 gloo ranks for all of them) -----------------------------


def _ddp_and_fsdp_hooks() -> dict[str, object]:
    """DDP's pre/post-forward and FSDP2's forward hooks called as aotgrad calls them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(3, 2))
    x = torch.randn(4, 3) + dist.get_rank()  # different on each rank
    modes = compat.ddp_modes(ddp)
    args, kwargs = compat.ddp_pre_forward(ddp, (x,), {})
    compat.ddp_post_forward(ddp, ddp.module(*args, **kwargs)).sum().backward()
    ddp_grad = ddp.module.weight.grad.tolist()  # all-reduced: the same on both ranks

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    root = compat.fsdp_state(model)
    bookkeeping = [a for a, v in vars(model).items() if compat.is_fsdp_bookkeeping(v)]
    args, kwargs = compat.fsdp_pre_forward(root, model, (x,), {})
    states = compat.fsdp_all_states(root)
    child = states[1]
    compat.fsdp_pre_forward(child, compat.fsdp_state_modules(child)[0], (), {})
    unsharded = type(model[0].weight).__name__
    before = compat.fsdp_pause_hooks(states)
    out = model(*args, **kwargs)  # the hooks run and do nothing: still unsharded after
    still_unsharded = type(model[0].weight).__name__
    compat.fsdp_resume_hooks(states, before)
    out = compat.fsdp_post_forward(child, model[0], out)
    out = compat.fsdp_post_forward(root, model, out)
    resharded = type(model[0].weight).__name__
    hooked = compat.fsdp_pre_backward_hooked(out, states)  # registered: child's, then root's
    out.sum().backward()
    groups = [g for s in states for g in compat.fsdp_param_groups(s)]
    idle = [g._all_gather_result is None for g in groups]
    compat.fsdp_start_all_gathers(states, backward=False)  # every group in flight, not waited
    in_flight = [g._all_gather_result is not None for g in groups]
    model(x).sum().backward()  # FSDP's own hooks wait for them and train as usual
    return {
        "started": idle + in_flight,
        "modes": modes,
        "ddp_grad": ddp_grad,
        "not_fsdp": compat.fsdp_state(torch.nn.Linear(1, 1)),
        "states": [states[0] is root, compat.fsdp_state_modules(child) == (model[0],)],
        "bookkeeping": len(bookkeeping) == 1 and not compat.is_fsdp_bookkeeping({}),
        "param_dtype": compat.fsdp_mixed_precision(root).param_dtype,
        "hooked": [hooked[0] is child, hooked[-1] is root, len(compat.fsdp_param_groups(child))],
        "types": [unsharded, still_unsharded, resharded, type(model[0].weight.grad).__name__],
    }


def test_ddp_and_fsdp_hooks_run_as_aotgrad_runs_them():
    from multiproc import run_ranks

    ranks = run_ranks(_ddp_and_fsdp_hooks, timeout=120)
    for result in ranks:
        assert not any(result["modes"].values())
        assert result["not_fsdp"] is None and all(result["states"]) and result["bookkeeping"]
        assert result["param_dtype"] is None
        assert result["hooked"] == [True, True, 1]
        assert result["started"] == [True, True, True, True]
        assert result["types"] == ["Parameter", "Parameter", "DTensor", "DTensor"]
    assert ranks[0]["ddp_grad"] == ranks[1]["ddp_grad"]


def test_prepend_tensor_hook_runs_first_and_is_removable():
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    ran: list[str] = []
    y.register_hook(lambda g: ran.append("first registered"))
    compat.prepend_tensor_hook(y, lambda g: ran.append("prepended"))
    y.register_hook(lambda g: ran.append("last registered"))
    y.sum().backward(retain_graph=True)
    assert ran == ["prepended", "first registered", "last registered"]
    for handle_id in list(y._backward_hooks)[:1]:  # the prepended one
        del y._backward_hooks[handle_id]
    ran.clear()
    y.sum().backward()
    assert ran == ["first registered", "last registered"]


def test_all_decompositions_reach_ops_outside_core_aten():
    table = compat.all_decompositions()
    for op in (aten._native_batch_norm_legit_functional.default, aten.as_strided_scatter.default):
        assert op in table and torch.Tag.core not in op.tags
    assert len(table) > 500


def test_decomposition_computes_the_op():
    silu_backward = compat.decomposition(torch.ops.aten.silu_backward.default)
    g, x = torch.randn(4), torch.randn(4)
    assert silu_backward is not None
    torch.testing.assert_close(silu_backward(g, x), torch.ops.aten.silu_backward(g, x))
    assert compat.decomposition(torch.ops.aten.copy.default) is None


# --- Global settings in the cache key, modes, errors for ops without meta kernels ---------------


def test_settings_readers_follow_their_switches():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert compat.math_sdp_enabled() and compat.flash_sdp_enabled()
    with sdpa_kernel(SDPBackend.MATH):
        assert compat.math_sdp_enabled() and not compat.flash_sdp_enabled()
        assert not compat.mem_efficient_sdp_enabled() and not compat.cudnn_sdp_enabled()
        assert not compat.overrideable_sdp_enabled()
    assert len(tuple(compat.sdp_priority_order())) == 5
    assert isinstance(compat.math_sdp_allows_reduction(), bool)
    before = compat.deterministic_algorithms()
    torch.use_deterministic_algorithms(not before)
    try:
        assert compat.deterministic_algorithms() is (not before)
    finally:
        torch.use_deterministic_algorithms(before)
    with torch.backends.cudnn.flags(enabled=False):
        assert compat.cudnn_enabled() is False
    with torch.backends.mkldnn.flags(enabled=False):
        assert compat.mkldnn_enabled() is False
    assert compat.opt_einsum_enabled() == torch.backends.opt_einsum.enabled
    assert compat.opt_einsum_strategy() == torch.backends.opt_einsum.strategy


def test_a_device_context_is_a_function_mode_found_by_its_place():
    assert compat.function_mode_count() == 0
    with torch.device("meta"):
        assert compat.function_mode_count() == 1
        mode = compat.function_mode_at(0)
        assert isinstance(mode, compat.DeviceContext) and mode.device == torch.device("meta")


def test_an_op_without_a_meta_kernel_says_so_under_fake_tensors():
    mode = compat.FakeTensorMode(allow_fallback_kernels=False)  # as capture's
    with mode:
        x = torch.randn(3)
    errors = (NotImplementedError, compat.UnsupportedOperatorException)
    with pytest.raises(errors) as e, mode:
        torch.ops.aten._sample_dirichlet(x)
    assert isinstance(e.value, compat.UnsupportedOperatorException) or (
        compat.NO_META_KERNEL in str(e.value)
    )


def test_engine_uses_follows_the_gradients_asked_for():
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, grad):
            seen.append([compat.engine_uses(node) for node, _ in ctx.next_functions])
            return grad, grad

    x, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    torch.autograd.grad(Spy.apply(x * 1, w).sum(), w)  # w's leaf is captured: counts as used
    Spy.apply(x * 1, w).sum().backward(inputs=[w])
    Spy.apply(x * 1, w).sum().backward()
    assert seen == [[False, True], [False, True], [True, True]]


def test_profiler_memory_events_are_allocations_and_frees_in_order():
    x = torch.randn(1000)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        y = x.sin()
        del y
    sizes = [n for _, n, kind in compat.profiler_memory_events(prof) if kind == "cpu"]
    assert sizes == [4000, -4000]


def test_is_non_overlapping_and_dense_tells_a_dense_layout():
    x = torch.randn(3, 4)
    assert compat.is_non_overlapping_and_dense(x.t())
    assert not compat.is_non_overlapping_and_dense(x[:, ::2])


@torch.library.custom_op("aotgrad_test_compat::no_fake", mutates_args=())
def _custom_without_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_custom_op_without_a_fake_impl_says_so_under_fake_tensors():
    mode = compat.FakeTensorMode(allow_fallback_kernels=False)
    with mode:
        x = torch.randn(3)
    with pytest.raises(RuntimeError) as e, mode:
        _custom_without_fake(x)
    assert compat.NO_FAKE_IMPL in str(e.value)


def test_numpy_of_a_fake_tensor_says_so():
    with compat.FakeTensorMode():
        x = torch.randn(3)
    with pytest.raises(RuntimeError) as e:
        x.numpy()
    assert compat.NUMPY_OF_TRACED in str(e.value)


def test_a_symbolic_size_hints_at_its_example_value():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = compat.FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.randn(5, 3), symbolic_context=None)
    assert all(isinstance(s, torch.SymInt) for s in x.shape)
    assert compat.size_hint(3) == 3
    assert [compat.size_hint(s) for s in x.shape] == [5, 3]
    assert sorted(compat.symbol_hints(x.shape[0] * x.shape[1] + 1).values()) == [3, 5]


def test_saved_data_reads_what_a_node_saved_without_unpacking():
    x = torch.ones(3, requires_grad=True)
    y = x * x
    data = compat.saved_data(y.grad_fn)
    assert len(data) == 2 and all(d is x for d in data)
    x.data.mul_(2)  # no version bump: the values are read as stored
    assert compat.saved_data((x.sin()).grad_fn)[0] is x


def test_disable_torch_dispatch_changes_a_wrapper_subclass_own_metadata():
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.ones(2, 3), torch.ones(2, 3))
    with compat.DisableTorchDispatch():
        t.as_strided_((3, 2), (1, 3))
    assert t.shape == (3, 2) and t.a.shape == (2, 3)


def test_shallow_copy_data_is_the_op_of_data_assignment_from_torch_2_14():
    if compat.TORCH_RELEASE < (2, 14):
        assert compat.SHALLOW_COPY_DATA is None
        return
    a, b = torch.zeros(3), torch.arange(3.0)
    compat.SHALLOW_COPY_DATA(a, b)
    assert torch.equal(a, b)
