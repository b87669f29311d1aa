"""Per-op knowledge, one table per kind of fact, each keyed by ``OpOverload``.

``table``: what each aten op is (view, in place, random, collective, its FLOPs);
``core_aten``: the named decomposition sets and the Core ATen check (``upsample``: the
backwards of ``F.interpolate`` written as forward ops); ``backward_ops``: backward ops written
as forward ops for backends that run only forward ops; ``file_ops``: the ops a graph file may
run. This package imports only ``_torch_compat``, ``errors`` and itself.
"""
