"""The exported programs run by backends nobody here wrote (docs/backends.md).

``step(programs, backend)`` compiles the flat forward and backward programs of
``traced.export(flat=True)`` with ONNX Runtime (``"onnxruntime"``) or IREE (``"iree"``) and
returns a callable that runs one step, forward then backward, naming each result by aotgrad's
descriptors. The backends are optional dependencies (``pip install aotgrad[backends]``),
imported when a step is built.
"""

from aotgrad.backends.step import BACKENDS, BackendStep, StepResult, step

__all__ = ["BACKENDS", "BackendStep", "StepResult", "step"]
