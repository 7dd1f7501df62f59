"""The transformers KV cache, in one place: a cached call's checks, the write-back of the graph's new cache tensors
into the caller's ``Cache`` object (HF updates caches in place), and the decoding state a converted model keeps in
extra cache layers (MSAR's conv history)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..capture import cache_problem, is_cache
from ..errors import ConfigError, DepthRewriteError


def check_cache(cache: Any, name: str) -> None:
    """A cache a captured graph cannot continue (a full sliding window; MSAR state of a cropped cache): ConfigError."""
    problem = cache_problem(cache)
    if problem is not None:
        raise ConfigError(problem)
    if cache.__dict__.get(EXTRA_LAYERS) and cache.get_seq_length() != cache.__dict__.get(SEEN_TOKENS):
        raise ConfigError(
            f"the KV cache passed to the converted {name} holds {cache.get_seq_length()} tokens, but its decoding state "
            f"(MSAR's conv history) was written after {cache.__dict__.get(SEEN_TOKENS)}: the cache was cropped or edited "
            "(assisted decoding's crop()), and the state cannot be rolled back. Decode without cropping, or with "
            "use_cache=False."
        )


def output_cache(out: Any) -> tuple[Any, Any]:
    """``(cache, where)``: the KV cache object in a model output (a ``ModelOutput`` field, or an element of the tuple
    ``return_dict=False`` gives) and its key or index; ``(None, None)`` when there is none."""
    if hasattr(out, "items") and hasattr(out, "keys"):  # ModelOutput (an OrderedDict)
        for k, v in out.items():
            if is_cache(v):
                return v, k
        return None, None
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if is_cache(v):
                return v, i
    return None, None


def write_back(cache: Any, out: Any, new_tokens: int | None = None) -> Any:
    """Put the graph's new cache tensors into the caller's cache object (HF updates caches in place) and return the
    output with that object in place of the graph's copy. Layers the caller's cache lacks (a ``DynamicCache()`` made
    without a config grows as it is updated) are added first."""
    new, where = output_cache(out)
    if new is None or new is cache:
        return out
    layers_in, layers_out = getattr(cache, "layers", None), getattr(new, "layers", None)
    seen = {id(la): la.cumulative_length for la in (layers_in or ()) if getattr(la, "is_initialized", False)
            and hasattr(la, "cumulative_length")}
    if layers_in is None or layers_out is None:
        raise DepthRewriteError(
            f"depthrewrite: cannot write the new KV cache back into the caller's {type(cache).__name__} (no layers)"
        )
    extra = cache.__dict__.get(EXTRA_LAYERS, 0)  # decoding state after the model's layers: passed through, stored apart
    own = len(layers_in) - extra
    layers_out = list(layers_out)[: len(layers_out) - extra]
    if own < len(layers_out):
        if extra:
            raise DepthRewriteError(
                f"depthrewrite: the caller's cache has {own} model layers and decoding state after them; the model "
                f"returned {len(layers_out)} layers"
            )
        for lo in layers_out[own:]:
            window = getattr(lo, "sliding_window", None)
            layers_in.insert(own, type(lo)(sliding_window=window) if window is not None else type(lo)())
            own += 1
    for li, lo in zip(layers_in[:own], layers_out):
        if getattr(lo, "keys", None) is None:
            continue
        if type(li) is not type(lo):
            raise DepthRewriteError(
                f"depthrewrite: layer of type {type(lo).__name__} returned for the caller's {type(li).__name__}"
            )
        if not getattr(li, "is_initialized", True):
            li.lazy_initialization(lo.keys, lo.values)
        li.keys, li.values = lo.keys, lo.values
        if hasattr(lo, "cumulative_length"):  # a sliding window counts every token, also those it no longer keeps
            li.cumulative_length = seen.get(id(li), 0) + new_tokens if new_tokens is not None else lo.cumulative_length
    if isinstance(where, int):
        out = type(out)(cache if i == where else v for i, v in enumerate(out))
    else:
        out[where] = cache
    return out


EXTRA_LAYERS = "_depthrewrite_extra_layers"
SEEN_TOKENS = "_depthrewrite_cached_tokens"  # the cache's length when the decoding state was last written


def history_of(cache: Any) -> list[torch.Tensor]:
    """The decoding state a converted model keeps in ``cache`` (MSAR's conv history): the keys then values of the
    extra layers it appended after the model's own, in order; ``[]`` when there are none."""
    n = cache.__dict__.get(EXTRA_LAYERS, 0) if cache is not None else 0
    if not n:
        return []
    return [t for layer in cache.layers[-n:] for t in (layer.keys, layer.values)]


def store_history(cache: Any, history: list[torch.Tensor]) -> None:
    """Keep ``history`` (``[B, 1, k-1, D]`` tensors) in ``cache`` as extra layers after the model's own, two tensors
    per layer, so ``reorder_cache`` (beam search) and ``batch_select_indices`` treat it as the rest of the cache."""
    if cache is None:
        raise DepthRewriteError(
            "depthrewrite: the converted model returned decoding state but the call has no KV cache object to keep it in"
        )
    from transformers.cache_utils import DynamicLayer

    tensors = list(history) + ([torch.zeros_like(history[-1])] if len(history) % 2 else [])
    n = len(tensors) // 2
    have = cache.__dict__.get(EXTRA_LAYERS, 0)
    if have not in (0, n):
        raise DepthRewriteError(f"depthrewrite: the cache holds {have} layers of decoding state, this call returns {n}")
    if not have:
        for _ in range(n):
            layer = DynamicLayer()
            layer.lazy_initialization(tensors[0], tensors[1])
            cache.layers.append(layer)
        cache.__dict__[EXTRA_LAYERS] = n
    for layer, k, v in zip(cache.layers[-n:], tensors[0::2], tensors[1::2]):
        layer.keys, layer.values = k, v


def history_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[str]:
    """The placeholders of ``gm`` that carry decoding state: the tensors of the extra layers a converted model
    appended to the call's KV cache (:func:`store_history`), keys then values per layer."""
    cache = next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)
    wanted = history_of(cache) if cache is not None else []
    if not wanted:
        return []
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    tensors = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    if len(leaves) != len(tensors):
        raise DepthRewriteError(
            f"depthrewrite: the captured graph has {len(tensors)} tensor inputs for the call's {len(leaves)}; cannot "
            "find the decoding state in the KV cache (a bug: please report it)"
        )
    index = {id(t): i for i, t in enumerate(leaves)}
    return [tensors[index[id(t)]].name for t in wanted]
