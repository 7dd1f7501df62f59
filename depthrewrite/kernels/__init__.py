"""Fused Triton kernels with their pure-PyTorch references (one folder per op)."""
