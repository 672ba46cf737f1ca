"""Compiler passes: pure graph -> graph functions, each returning a report of what it did."""
from .report import Report  # noqa: F401
