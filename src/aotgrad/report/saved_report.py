"""The saved-activation report: what the backward keeps alive, how big, and why."""

from __future__ import annotations

import os
from collections.abc import Sequence

from aotgrad.partition import SavedValue
from aotgrad.partition.saved import unique_bytes
from aotgrad.partition.sizes import hint, sizes_text, symbols_of


def format_bytes(n: int) -> str:
    """``1536`` → ``'1.5 KiB'``.

    >>> format_bytes(1536), format_bytes(12)
    ('1.5 KiB', '12 B')
    """
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def memory_report(saved: Sequence[SavedValue], by_module: bool = False) -> str:
    """Saved values largest first, with the total of unique storages; optionally per module."""
    if not by_module:
        return "\n".join([*_rows(saved), _total(saved)])
    lines = []
    # In the order first saved among ties: the same text in every process (a set's order
    # follows the hash seed).
    modules = sorted(
        dict.fromkeys(s.module for s in saved), key=lambda m: -hint(unique_bytes(_of(saved, m)))
    )
    for module in modules:
        group = _of(saved, module)
        lines.append(f"[{module}] {format_bytes(hint(unique_bytes(group)))}")
        lines += ["  " + row for row in _rows(group)[2:]]
    lines.append(_total(saved))
    return "\n".join(lines)


def _of(saved: Sequence[SavedValue], module: str) -> list[SavedValue]:
    return [s for s in saved if s.module == module]


def _rows(saved: Sequence[SavedValue]) -> list[str]:
    header = (
        f"{'name':<18} {'shape':<14} {'dtype':<9} {'bytes':>14}  {'producer':<28}"
        f" {'module':<16} {'source':<28} reason"
    )
    rows = [header, "-" * len(header)]
    # At the example sizes under dynamic shapes: Note [Saved bytes of symbolic sizes].
    for s in sorted(saved, key=lambda s: (-hint(s.nbytes), s.name)):
        shape = "x".join(map(str, s.shape)) or "scalar"
        size = f"{format_bytes(hint(s.nbytes))}{' (input)' if s.is_input else ''}"
        where = (
            "" if s.source is None else f"{os.path.basename(s.source.filename)}:{s.source.lineno}"
        )
        dtype = str(s.dtype).removeprefix("torch.")
        rows.append(
            f"{s.name:<18} {shape:<14} {dtype:<9} {size:>14}  {s.producer:<28}"
            f" {s.module:<16} {where:<28} {s.reason}"
        )
    return rows


def _total(saved: Sequence[SavedValue]) -> str:
    total = unique_bytes(saved)
    beyond = unique_bytes([s for s in saved if not s.is_input])
    text = (
        f"total: {format_bytes(hint(total))} in {len({s.storage for s in saved})} storage(s)"
        f" ({format_bytes(hint(beyond))} beyond the inputs)"
    )
    sizes = symbols_of([total, *(n for s in saved for n in s.shape)])
    if not sizes:
        return text
    return f"{text} at the example sizes {sizes_text(sizes)}; at any size: {total} bytes"


# Note [Saved bytes of symbolic sizes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under dynamic shapes a saved value's bytes are a SymInt (``128*s0``). The
# report sorts and prints them at the example sizes (Note [Weights at the
# example sizes]), shows each shape with its symbols, and ends with the sizes
# and the total as an expression, exact at every size::
#
#     addmm     s0x32   float32   1.0 KiB  aten.addmm.default ...
#     total: 6.7 KiB in 11 storage(s) (2.1 KiB beyond the inputs) at the example
#     sizes s0 = 8; at any size: 456*s0 + 4224 bytes
#
# ``float()`` or a comparison of the SymInt would add a guard (``s0 == 8``)
# and narrow the sizes the capture serves.
