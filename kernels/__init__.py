"""Triton kernels for the worker forward, each beside its PyTorch reference."""
