"""Reports read the pipeline's results; nothing in the pipeline imports them."""

from aotgrad.report.saved import format_bytes, memory_report
from aotgrad.report.seq_table import SeqRow, SeqTable, seq_table

__all__ = ["SeqRow", "SeqTable", "format_bytes", "memory_report", "seq_table"]
