"""Per-op knowledge, one table per kind of fact, each keyed by ``OpOverload``.

Where each kind of fact lives (a rule table is an ``rules.OpRules``, each entry registered
beside its rule):

- what an op is: view, random (and whether a call draws), pointwise, collective, FLOPs,
  reads strides, needs grad mode, autocast, outputs an input reaches, gradients it passes:
  ``table`` (read from the schema, plus small tables beside each question);
- its Core ATen decomposition: ``core_aten.EXTRA_DECOMPOSITIONS`` (aotgrad's rules, with
  ``upsample``'s ``F.interpolate`` backwards), ``FROM_TORCH_DECOMP`` (PyTorch's),
  ``NO_EXACT_DECOMPOSITION`` (refused, with why), and the check that a graph is Core ATen;
- a backward op written as forward ops, for backends: ``backward_ops.AS_FORWARD_OPS`` and
  ``backward_ops.decompose``, the one decomposition step before a backend compiles;
- how the differentiable backward runs an op without a (right) derivative:
  ``differentiable.WITHOUT_DERIVATIVE`` and ``differentiable.REPLACED``;
- whether a graph file may run an op: ``file_ops.refusal``;
- what a random draw reads of its inputs (its layout alone, or values): ``draws.METADATA_ONLY``,
  and the ops that draw and compute at once, split in two: ``draws.SPLIT_DRAWS``
  (Note [Random draws as inputs] in ``partition/draws.py``).

Tables that are one mechanism's own stay beside it, outside this package: the fast path's
fake-mode shortcuts and direct-trace rules (``capture/tracing/fast``: ``layouts.LAYOUTS``,
``view_writes.VIEWS``, ``direct._UNANNOTATED_WRITES``; they re-derive what PyTorch's
machinery knows, and leave with the layer when ``fast=False``: Note [The fast path as a
layer]); the ops that trigger one analysis and whose handlers take its state
(``capture/analyses``: ``random._FILLS``, the ``aotgrad::fill_random`` op's own table;
``set_storage.SET_OPS``; ``mutation.RESIZE_OPS``; ``capture/tracing/fake._EAGER_SIZES``,
which builds the fake mode's tensors; ``collectives._SAME_SHAPE`` and ``_FUNCTIONAL_FORM``,
the cross-rank check's and one refusal's); and each backend's rewrites, what its exporter or
compiler gets wrong (``backends/onnxruntime.py``, ``backends/iree.py``). This package
imports only ``_torch_compat``, ``errors`` and itself.
"""
