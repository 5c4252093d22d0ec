"""Shared test set-up. Triton decides between compiling and interpreting when a kernel is
defined, so the interpreter is switched on here, before any test module imports a kernel."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
