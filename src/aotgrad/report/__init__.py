"""Reports read the pipeline's results; nothing in the pipeline imports them."""

from aotgrad.report.saved import format_bytes, saved_table

__all__ = ["format_bytes", "saved_table"]
