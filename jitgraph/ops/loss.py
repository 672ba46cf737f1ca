"""Losses: cross_entropy (class labels or probability targets), mse."""
from __future__ import annotations

__all__ = []
