"""Triton kernels for the GPU worker, each beside a plain-PyTorch reference. A leaf: nothing here imports the rest of
``stride``; launchers take what they need as arguments.

Importing this package does nothing by itself. Without CUDA, Triton runs kernels only through its interpreter, and
it decides that when it is first imported, from ``TRITON_INTERPRET``: whoever runs these kernels on a CPU sets it
first (the worker when it picks the triton backend there, the test suite's ``conftest.py``).
"""
