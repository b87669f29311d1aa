"""Frontend: ``scan`` and ``scan_layers``, one body captured once and run in a loop.

See ``docs/scan.md`` and Note [Scan's calling convention].
"""

from aotgrad.scan.layers import scan_layers
from aotgrad.scan.loop import ScanFunction, scan, scan_function, unrolled

__all__ = ["ScanFunction", "scan", "scan_function", "scan_layers", "unrolled"]
