"""aotgrad: ahead-of-time autograd for PyTorch.

Capture a function's forward and backward as functional aten ``torch.fx``
graphs on fake tensors, split them, compile each, and get back a callable
with ordinary autograd semantics, plus a calling convention you can read.

>>> import torch, aotgrad
>>> traced = aotgrad.trace(lambda x: x.sin(), torch.ones(2, requires_grad=True))
>>> traced.signature.backward_outputs
(Grad(of=Input(path='x')),)
"""

from aotgrad import compilers
from aotgrad.api import AOTModule, Traced, aot_function, aot_module, load, trace
from aotgrad.cache import CacheInfo, cache_info
from aotgrad.capture.analyses.dynamic import dynamic
from aotgrad.dynamo import backend
from aotgrad.errors import (
    AotgradError,
    AutocastBackwardError,
    BackendError,
    CallError,
    CaptureError,
    ConfigError,
    DataDependentError,
    DirectTraceError,
    DoubleBackwardError,
    InPlaceOnLeafError,
    OpError,
    PartitionError,
    ScanError,
    StoreError,
    TransformError,
    UnsupportedClosureError,
    UnsupportedMutationError,
    UnsupportedOpError,
    UnsupportedOutputError,
    UnsupportedWrapperError,
)
from aotgrad.loops import ScanFunction, scan, scan_function, scan_layers, scan_layers_function
from aotgrad.partition import budget
from aotgrad.profiling import ProfileReport, profile
from aotgrad.runtime import make_boxed_func, nop
from aotgrad.store.loaded import Loaded

__all__ = [
    "AOTModule",
    "AotgradError",
    "AutocastBackwardError",
    "BackendError",
    "CacheInfo",
    "CallError",
    "CaptureError",
    "ConfigError",
    "DataDependentError",
    "DirectTraceError",
    "DoubleBackwardError",
    "InPlaceOnLeafError",
    "Loaded",
    "OpError",
    "PartitionError",
    "ProfileReport",
    "ScanError",
    "ScanFunction",
    "StoreError",
    "Traced",
    "TransformError",
    "UnsupportedClosureError",
    "UnsupportedMutationError",
    "UnsupportedOpError",
    "UnsupportedOutputError",
    "UnsupportedWrapperError",
    "aot_function",
    "aot_module",
    "backend",
    "budget",
    "cache_info",
    "compilers",
    "dynamic",
    "load",
    "make_boxed_func",
    "nop",
    "profile",
    "scan",
    "scan_function",
    "scan_layers",
    "scan_layers_function",
    "trace",
]
