"""Frontend for loops: ``scan`` and ``scan_layers``, one body captured once and run in a loop.

(The package is not named ``scan``: ``aotgrad.scan`` is the function.)

See ``docs/scan.md`` and Note [Scan's calling convention].
"""

from aotgrad.loops.layers import scan_layers, scan_layers_function
from aotgrad.loops.loop import ScanFunction, scan, scan_function, unrolled

__all__ = [
    "ScanFunction",
    "scan",
    "scan_function",
    "scan_layers",
    "scan_layers_function",
    "unrolled",
]
