"""Stage 1: the calling convention. Flatten the user's call into described graph inputs.

Entry point: :func:`flatten_inputs`. The descriptors and the :class:`Signature`
built from them are shared vocabulary for every later stage. What the function
reads besides its arguments (module state, closed-over tensors, module
arguments) is lifted to leading inputs by ``lifting.py``.
"""

from aotgrad.signature.convention import SIGNATURE_VERSION, Signature
from aotgrad.signature.descriptors import (
    Buffer,
    Cotangent,
    Descriptor,
    Draw,
    Grad,
    GraphInputDescriptor,
    Inner,
    Input,
    InputBase,
    MultiOutputView,
    MutatedInput,
    Output,
    OutputBase,
    Param,
    PrimalDescriptor,
    Saved,
    SideEffect,
    StateAtBackward,
)
from aotgrad.signature.flatten import (
    FlatInputs,
    PlainTensorsGuard,
    alias_key,
    call_key,
    dynamic_call_key,
    flatten_inputs,
    leaf_names,
    register_dataclasses,
)
from aotgrad.signature.printing import describe_graph
from aotgrad.signature.storage import storage_key, storage_nbytes

__all__ = [
    "SIGNATURE_VERSION",
    "Buffer",
    "Cotangent",
    "Descriptor",
    "Draw",
    "FlatInputs",
    "Grad",
    "GraphInputDescriptor",
    "Inner",
    "Input",
    "InputBase",
    "MultiOutputView",
    "MutatedInput",
    "Output",
    "OutputBase",
    "Param",
    "PlainTensorsGuard",
    "PrimalDescriptor",
    "Saved",
    "SideEffect",
    "Signature",
    "StateAtBackward",
    "alias_key",
    "call_key",
    "describe_graph",
    "dynamic_call_key",
    "flatten_inputs",
    "leaf_names",
    "register_dataclasses",
    "storage_key",
    "storage_nbytes",
]
