"""Triton kernels for the GPU worker, each beside a plain-PyTorch reference.

Without CUDA, Triton runs kernels only through its interpreter, and it decides that when a kernel is
defined (at import). So importing this package on a machine without CUDA turns the interpreter on,
unless ``TRITON_INTERPRET`` is already set: CPU tests then run the very same kernels on CPU tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
