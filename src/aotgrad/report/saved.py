"""The saved-activation table: what the backward keeps alive, how big, and why."""

from __future__ import annotations

from collections.abc import Sequence

from aotgrad.partition import SavedValue


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


def saved_table(saved: Sequence[SavedValue]) -> str:
    """One row per saved value, largest first, with the total held beyond the inputs."""
    header = f"{'name':<16} {'shape':<18} {'dtype':<14} {'bytes':>10}  {'producer':<28} reason"
    rows = [header, "-" * len(header)]
    for s in sorted(saved, key=lambda s: -s.nbytes):
        bytes_text = "(input)" if s.is_input else format_bytes(s.nbytes)
        shape = "x".join(map(str, s.shape)) or "scalar"
        rows.append(
            f"{s.name:<16} {shape:<18} {s.dtype!s:<14} {bytes_text:>10}  {s.producer:<28} {s.reason}"
        )
    total = sum(s.nbytes for s in saved if not s.is_input)
    rows.append(f"total saved beyond inputs: {format_bytes(total)} in {len(saved)} value(s)")
    return "\n".join(rows)
