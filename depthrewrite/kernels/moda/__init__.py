"""MoDA: one joint softmax over a layer's sequence keys and the same token's depth slots."""

from .op import kernel_covers, moda_attn, moda_attn_backward, moda_attn_slots, moda_attn_slots_stack, moda_stack_slots
from .reference import moda_attn_ref, moda_slots_ref

__all__ = ["moda_attn", "moda_attn_backward", "moda_attn_slots", "moda_attn_slots_stack", "moda_stack_slots",
           "moda_attn_ref", "moda_slots_ref", "kernel_covers"]
