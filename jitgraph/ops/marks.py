"""Marks: identity ops that annotate a value for a compiler pass and compute nothing.

`checkpoint(x)` marks x as a value the backward pass keeps (passes/checkpoint.py, "marks" policy);
everything between two marks is recomputed. The pass removes the marks; left in a graph, a mark
is a view (it aliases its operand's buffer) and its gradient passes straight through.
"""
from __future__ import annotations

from .common import apply
from ..registry import register

register("checkpoint", arity=1, kind="view", infer=lambda args, a: args[0].type,
         ref=lambda a, x: x.copy(), vjp=lambda g, out, xs, a: [g],
         doc="identity; marks a value to keep for the backward pass (gradient checkpointing)")


def checkpoint(x):
    """Keep x for the backward pass; values between two marks are recomputed there."""
    return apply("checkpoint", x)


__all__ = ["checkpoint"]
