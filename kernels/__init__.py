"""Triton kernels for the GPU worker, each beside a plain-PyTorch reference."""
