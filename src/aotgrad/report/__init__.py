"""Reports read the pipeline's results; nothing in the pipeline imports them."""

from aotgrad.report.document import SCHEMA, show_document
from aotgrad.report.html import render_html
from aotgrad.report.peak_report import peak_report
from aotgrad.report.saved_report import format_bytes, memory_report
from aotgrad.report.seq_table import SeqRow, SeqTable, seq_table

__all__ = [
    "SCHEMA",
    "SeqRow",
    "SeqTable",
    "format_bytes",
    "memory_report",
    "peak_report",
    "render_html",
    "seq_table",
    "show_document",
]
