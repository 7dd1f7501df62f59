"""A CPU stand-in for the two flash-attn 2 functions OLMo-core's ``flash_2`` attention backend calls
(``flash_attn_func`` and ``flash_attn_with_kvcache``), so that its KV cache (the backend's only cache) can be tried
without a GPU. Causal attention only, written from flash-attn's documented semantics: ``flash_attn_with_kvcache``
writes the new keys/values into the caches at ``cache_seqlens`` (in place) and attends each query at absolute position
``cache_seqlens + t`` over the cache up to itself, skipping the first ``cache_leftpad`` positions. Registered as
custom ops (the cache write declared as a mutation), so torch.export traces through them."""

from __future__ import annotations

import contextlib
import types
import unittest.mock
from typing import Iterator

import torch
from torch import Tensor


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, start: Tensor, end: Tensor, leftpad: Tensor) -> Tensor:
    """Query ``t`` of row ``b`` sits at position ``start[b] + t`` and sees keys in ``[leftpad[b], min(end[b], pos]]``."""
    B, T, H, _ = q.shape
    S, Hk = k.shape[1], k.shape[2]
    k, v = k.to(q.dtype).repeat_interleave(H // Hk, dim=2), v.to(q.dtype).repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    pos_q = (start[:, None] + torch.arange(T))[:, :, None]
    pos_k = torch.arange(S)[None, None, :]
    ok = (pos_k <= pos_q) & (pos_k < end[:, None, None]) & (pos_k >= leftpad[:, None, None])
    return torch.einsum("bhts,bshd->bthd", s.masked_fill(~ok[:, None], float("-inf")).softmax(-1), v).contiguous()


@torch.library.custom_op("dr_test_flash::attn", mutates_args=())
def _flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    return _attend(q, k, v, scale, zero, zero + q.shape[1], zero)


@_flash.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


@torch.library.custom_op("dr_test_flash::attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _flash_kv(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor,
              cache_leftpad: Tensor, scale: float) -> Tensor:
    T = q.shape[1]
    for b, s0 in enumerate(cache_seqlens.tolist()):
        k_cache[b, s0:s0 + T] = k[b].to(k_cache.dtype)
        v_cache[b, s0:s0 + T] = v[b].to(v_cache.dtype)
    start = cache_seqlens.long()
    return _attend(q, k_cache, v_cache, scale, start, start + T, cache_leftpad.long())


@_flash_kv.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, cache_leftpad, scale):
    return torch.empty_like(q)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **_):
    assert causal and tuple(window_size) == (-1, -1) and dropout_p == 0.0, "the stand-in is causal attention only"
    return _flash(q, k, v, softmax_scale or q.shape[-1] ** -0.5)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_leftpad=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), **_):
    assert causal and tuple(window_size) == (-1, -1) and k is not None, "the stand-in is causal attention only"
    pad = cache_leftpad if cache_leftpad is not None else torch.zeros(q.shape[0], dtype=torch.int32)
    return _flash_kv(q, k_cache, v_cache, k, v, cache_seqlens, pad, softmax_scale or q.shape[-1] ** -0.5)


@contextlib.contextmanager
def olmo_flash_on_cpu() -> Iterator[None]:
    """OLMo-core's flash-attn 2 API served by the stand-in while entered."""
    import olmo_core.nn.attention.flash_attn_api as api

    fake = types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_with_kvcache=flash_attn_with_kvcache)
    with unittest.mock.patch.object(api, "flash_attn_2", fake):
        yield


def build_olmo_flash(name: str = "llama_like"):
    """``tests.frameworks.models.build("olmo_core", name)`` with the ``flash_2`` attention backend (OLMo-core falls
    back to its torch backend when ``torch.cuda.is_available()`` reads False at construction: it reads True here, at
    construction only). Call it inside :func:`olmo_flash_on_cpu`."""
    from .models import build

    with unittest.mock.patch("torch.cuda.is_available", lambda: True):
        return build("olmo_core", name, attn_backend="flash_2")
