"""The numba CPU target."""
