"""Kernel code generation per target, the kernel cache and the executor."""
