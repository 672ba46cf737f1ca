"""Neural-network ops: softmax, log_softmax, rms_norm, layer_norm, rope, causal_mask, conv2d,
max_pool2d, avg_pool2d, and their dedicated backward ops."""
from __future__ import annotations

__all__ = []
