"""Which operators a graph file may run (Note [Ops a file may run]).

Note [Ops a file may run]
~~~~~~~~~~~~~~~~~~~~~~~~~
A graph file names its ops by their registered names, and any registered op
can be looked up: ``aten.from_file(path, shared=True)`` maps a file of the
writer's choosing, and a ``copy_`` into it then wrote that file when the loaded
graph ran. A loaded graph may hold only what aotgrad itself writes into the
functional graphs it captures, decided from each op's schema and a short table:

    aten.mm.default, prims.convert_element_type.default   -> allowed: functional
    aten.copy_.default(x, new), x a graph input, unused   -> allowed: Note [Mutations
                                                              kept in the graph] writes it
    aten.add_.Tensor, aten.mm.out, aten.set_.source_Storage
                                                          -> refused: writes an argument
                                                              (``Tensor(a!)`` in its schema)
    aten.from_file.default, aten._copy_from.default       -> refused: ``_REFUSED`` (reads a
                                                              file / writes its ``dst``)
    aten._print.default, aten._cufft_clear_plan_cache     -> refused: returns nothing, so it
                                                              runs for a side effect
    aten._assert_async.msg                                 -> allowed: ``_CHECKS`` (raises)
    torchvision.nms.default, _c10d_functional.all_reduce   -> refused: not aten or prims

Only ``aten`` and ``prims`` are read: aotgrad does not store graphs with
collectives (their process group is this run's), and a custom op's side
effects are not in its schema. Saving applies the same rule, so every file
aotgrad writes loads; a graph with any other op is traced again instead.
"""

from __future__ import annotations

import torch

from aotgrad._torch_compat import OpOverload

NAMESPACES = frozenset({"aten", "prims"})

# Ops whose schema does not say that they touch the world: each with why.
_REFUSED: dict[str, str] = {
    "aten::from_file": "it reads (and with shared=True writes) a file",
    "aten::_copy_from": "it writes its dst argument",
    "aten::_copy_from_and_resize": "it writes its dst argument",
    "aten::_print": "it prints",
    "aten::_pin_memory": "it changes how host memory is allocated",
    "aten::pin_memory": "it changes how host memory is allocated",
}
# Ops that return nothing and only check their arguments (raise when a check fails).
_CHECKS = frozenset(
    {
        "aten::_assert_async",
        "aten::_assert_scalar",
        "aten::_assert_tensor_metadata",
        "aten::_linalg_check_errors",
        "aten::sym_constrain_range",
        "aten::sym_constrain_range_for_size",
    }
)
# The one writing op aotgrad emits, in one form only (checked by the graph reader).
INPUT_MUTATION = torch.ops.aten.copy_.default


def refusal(op: OpOverload) -> str | None:
    """Why a graph file may not run ``op``; None when it may (Note [Ops a file may run]).

    >>> refusal(torch.ops.aten.mm.default) is None
    True
    >>> refusal(torch.ops.aten.from_file.default)
    'it reads (and with shared=True writes) a file'
    >>> refusal(torch.ops.aten.add_.Tensor)
    "it writes its argument 'self' (Tensor(a!) in its schema)"
    """
    if op.namespace not in NAMESPACES:
        return f"it is not an aten or prims op (namespace {op.namespace!r})"
    schema = op._schema
    if schema.name in _REFUSED:
        return _REFUSED[schema.name]
    if op is INPUT_MUTATION:
        return None
    for argument in schema.arguments:
        if argument.alias_info is not None and argument.alias_info.is_write:
            return f"it writes its argument {argument.name!r} (Tensor(a!) in its schema)"
        kind = str(argument.type)
        if "Storage" in kind:
            return f"it takes a storage ({argument.name!r})"
        if "str" in kind and argument.name in ("filename", "path", "file"):
            return f"it names a file ({argument.name!r})"
    if not schema.returns and schema.name not in _CHECKS:
        return "it returns nothing, so it runs only for a side effect"
    return None
