"""nn.Module -> FX GraphModule, through ``torch.export`` (non-strict, training IR) with dynamic batch and sequence.

When no inputs are given, :func:`example_inputs_for` builds them for Hugging Face ``PreTrainedModel``s (token ids
from the config's vocabulary, or an image for vision models) and for timm models (an image of the model's input
size). The captured graph keeps ``nn_module_stack`` on every node, which the analysis uses for module paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import re
import sys
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from .errors import CaptureError
from .flexattention import capturing as capturing_flex, is_block_mask, register_block_mask_for
from .flexattention import retarget as retarget_flex

__all__ = ["capture", "example_inputs_for", "unalias_inputs", "ExampleInputs", "is_cache", "cache_problem",
           "StateWrite", "state_writes", "CONTINUATION_META"]

log = logging.getLogger(__name__)

ExampleInputs = tuple[tuple[Any, ...], dict[str, Any]]

DEFAULT_BATCH = 2
DEFAULT_SEQ = 16


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "main_input_name") and hasattr(model.config, "model_type")


def _is_timm(model: nn.Module) -> bool:
    return type(model).__module__.startswith("timm.") and hasattr(model, "pretrained_cfg")


def example_inputs_for(model: nn.Module, batch: int = DEFAULT_BATCH, seq: int = DEFAULT_SEQ) -> ExampleInputs:
    """Example ``(args, kwargs)``: token ids (or an image) for Hugging Face models, an image for timm models, token ids
    for any other model with an ``nn.Embedding``; :class:`CaptureError` otherwise."""
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    if device is None:  # every weight offloaded by accelerate (meta until its hook loads it): its execution device
        from .runtime.offload import accelerate_hooks

        device = torch.device(next((h.execution_device for m in model.modules() for h in accelerate_hooks(m)
                                    if getattr(h, "execution_device", None) is not None), "cpu"))
    if _is_hf(model):
        cfg = model.config
        kwargs: dict[str, Any] = {}
        name = model.main_input_name
        if name == "pixel_values":
            size = getattr(cfg, "image_size", 224)
            size = size if isinstance(size, (tuple, list)) else (size, size)
            chans = getattr(cfg, "num_channels", 3)
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            kwargs[name] = torch.randn(batch, chans, *size, device=device, dtype=dtype)
        else:
            vocab = getattr(cfg, "vocab_size", None) or 2
            limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or seq
            limit = limit if isinstance(limit, int) and limit > 0 else seq  # XLNet: -1, "no limit"
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, vocab, (batch, min(seq, limit)), generator=g).to(device)
            kwargs[name] = ids
        return (), kwargs
    if _is_timm(model):
        # pretrained_cfg keeps the registered size (224) when the model is built with another img_size; the patch
        # embedding (ViT, DeiT, BEiT, Swin, ...) holds the size the model was built for.
        c, h, w = model.pretrained_cfg.get("input_size", (3, 224, 224))
        patch = getattr(model, "patch_embed", None)
        size = getattr(patch, "img_size", None)
        if isinstance(size, int):
            size = (size, size)
        if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) for v in size):
            h, w = size
        c = getattr(getattr(patch, "proj", None), "in_channels", c)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return (torch.randn(batch, c, h, w, device=device, dtype=dtype),), {}
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:  # a hand-written language model (nanoGPT style): token ids into its first embedding
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, emb.num_embeddings, (batch, seq), generator=g).to(device),), {}
    raise CaptureError(
        f"cannot build example inputs for {type(model).__name__}: it is not a Hugging Face PreTrainedModel, not a "
        "timm model, and has no nn.Embedding to draw token ids for. Pass example_inputs=(tensor, ...) (and "
        "example_kwargs={...} if needed)."
    )


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Batch (dim 0) of every tensor and the sequence (dim 1) of integer token/mask tensors are dynamic.

    Keyed by the names of ``forward``'s parameters, as ``torch.export`` matches them."""

    def spec(x: Any, cached: bool = False) -> Any:
        if not isinstance(x, torch.Tensor):
            return None
        dims = {}
        if x.dim() >= 1:
            dims[0] = Dim.AUTO
        if x.dim() >= 2 and not x.is_floating_point():
            dims[1] = Dim.AUTO
        if cached and x.dim() >= 3:  # a KV cache tensor [batch, heads, cached length, head dim]
            dims[x.dim() - 2] = Dim.AUTO
        return dims or None

    def walk(x: Any, cached: bool = False) -> Any:
        if isinstance(x, torch.Tensor):
            return spec(x, cached)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(walk(v, cached) for v in x)
        if isinstance(x, dict):
            return {k: walk(v, cached) for k, v in x.items()}
        node = torch.utils._pytree.SUPPORTED_NODES.get(type(x))
        if node is not None:  # a registered container (a KV cache): export takes its children's shapes as a list
            children, _ = node.flatten_fn(x)
            if is_block_mask(x):  # static: its sequence lengths (in the tree's context) are fixed anyway
                return [None] * len(children)
            return [walk(c, cached or is_cache(x)) for c in children]
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {k: walk(v) for k, v in bound.items()}


def is_cache(x: Any) -> bool:
    """Whether ``x`` is a KV cache object (a transformers ``Cache``: ``DynamicCache`` and friends)."""
    return type(x).__name__.endswith("Cache") and hasattr(x, "get_seq_length")


_CACHE_REGISTERED = False


def register_cache_support() -> None:
    """Make a ``transformers`` ``DynamicCache`` a pytree node (transformers' own registration, done once), so export
    takes and returns its tensors and call structures see its layout."""
    global _CACHE_REGISTERED
    if _CACHE_REGISTERED:
        return
    _CACHE_REGISTERED = True
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:  # pragma: no cover - transformers without export support
        return
    register_dynamic_cache_export_support()


def _cache_support(args: tuple, kwargs: dict) -> None:
    """Register cache support; a cache :func:`cache_problem` refuses is a :class:`CaptureError`."""
    caches = [x for x in (*args, *kwargs.values()) if is_cache(x)]
    register_cache_support()
    for c in caches:
        problem = cache_problem(c)
        if problem is not None:
            raise CaptureError(problem)


def cache_problem(cache: Any) -> str | None:
    """Why a call with ``cache`` cannot run a captured graph, or None. A ``DynamicCache`` of full-attention layers
    works; so do sliding-window layers until the window is full (their token count is a Python int the trace reads
    from the cached length; once the window drops tokens the two differ)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # pragma: no cover
        return None
    layers = list(getattr(cache, "layers", ()))
    if type(cache) is not DynamicCache or any(type(la) not in (DynamicLayer, DynamicSlidingWindowLayer) for la in layers):
        kinds = sorted({type(la).__name__ for la in layers})
        return (
            f"depthrewrite runs cached calls with a transformers DynamicCache of full-attention or sliding-window layers; "
            f"this call passes a {type(cache).__name__} ({', '.join(kinds) or 'no layers'}). Call with use_cache=False "
            "(or generate(..., use_cache=False)), or pass a DynamicCache."
        )
    for i, la in enumerate(layers):
        if type(la) is DynamicSlidingWindowLayer and la.is_initialized and (
            la.record_past or la.cumulative_length != la.keys.shape[-2]
        ):
            return (
                f"layer {i} of the KV cache is a sliding window of {la.sliding_window} tokens that is full "
                f"({la.cumulative_length} tokens seen): a captured graph reads the token count from the cached length, "
                "which no longer holds. Decode this far with use_cache=False."
            )
    return None


def _cache_configs(model: nn.Module) -> list[Any]:
    """The configs with ``use_cache`` on: the model's, its submodules', and their sub-configs (``text_config``...)."""
    out: list[Any] = []
    seen: set[int] = set()
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen or not hasattr(c, "to_dict"):
            continue
        seen.add(id(c))
        if getattr(c, "use_cache", None) is True:
            out.append(c)
        todo += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return out


def _storage_key(t: torch.Tensor) -> tuple | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage (e.g. some wrappers)
        return None
    return (t.device, st.data_ptr()) if st.nbytes() else None


def unalias_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
    """Give every example tensor its own storage.

    ``torch.export`` keeps the aliasing of its example inputs: two arguments that are the same tensor (or views of one
    storage) become one graph input, and every later call reads the first of them for both. The usual Hugging Face
    idiom ``model(input_ids=ids, labels=ids)`` would then yield a graph that embeds the *labels*. A tensor that shares
    its storage with an earlier one is replaced by a copy (same values, dtype, device and ``requires_grad``).

    Returns:
        ``(args, kwargs, names)``: the de-aliased inputs and the names (``args[i]`` / the keyword, with a pytree path
        for nested inputs) of the tensors that were copied.
    """
    seen: dict[tuple, str] = {}
    copied: list[str] = []

    def fix(path, x):
        if not isinstance(x, torch.Tensor):
            return x
        name = torch.utils._pytree.keystr(path)
        key = _storage_key(x)
        if key is None:
            return x
        if key in seen:
            copied.append(f"{name} (shares storage with {seen[key]})")
            return x.detach().clone().requires_grad_(x.requires_grad)
        seen[key] = name
        return x

    args, kwargs = torch.utils._pytree.tree_map_with_path(fix, (tuple(args), dict(kwargs)))
    return tuple(args), dict(kwargs), copied


#: gm.meta key of a converted graph that writes state into the model's buffers while its scheme mixes across tokens:
#: ``(writes, why)``, checked on every call by the converted model (a continuation of such state is refused)
CONTINUATION_META = "depthrewrite_continuation"


@dataclasses.dataclass(frozen=True)
class StateWrite:
    """A captured graph writing into a buffer of the model in place: state that outlives the call (a KV cache the
    model keeps in its own buffers, as litgpt's ``set_kv_cache`` and torchtune's ``setup_caches`` do). ``buffer`` is
    the buffer's path, ``node`` the writing node, ``positions`` the graph input that says where along the sequence
    the call's tokens are written (``input_pos``), or None when the index is computed inside the graph (from other
    buffers), and ``positions_index`` its position among the graph's tensor inputs."""

    buffer: str
    node: str
    positions: str | None
    positions_index: int | None


#: ops that return a view of their first argument: an in-place write through one writes the buffer below it
_VIEWS = {"alias", "view", "_unsafe_view", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze",
          "expand", "as_strided", "narrow", "unflatten", "diagonal", "view_as", "reshape", "mT", "movedim", "unbind"}
#: ops an index tensor passes through on its way from a graph input (a cast, a copy, a reshape)
_INDEX_THROUGH = _VIEWS | {"to", "_to_copy", "clone", "contiguous", "type_as", "long", "int", "flatten",
                           "_assert_tensor_metadata"}


def _aten_name(node: fx.Node) -> str | None:
    """The aten op name of a call node without overload or in-place underscore (``index_copy_`` -> ``index_copy``)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return None
    base = t._schema.name.split("::")[-1]
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


def _through(node: Any, names: set[str], limit: int = 32) -> Any:
    """Walk from ``node`` up its first argument while it is one of ``names`` (views, casts)."""
    for _ in range(limit):
        if not isinstance(node, fx.Node) or _aten_name(node) not in names or not node.args:
            return node
        node = node.args[0]
    return node


def state_writes(gm: fx.GraphModule) -> list[StateWrite]:
    """Every in-place write of ``gm`` into one of its buffers (through views of it), read from the ops' schemas:
    what a call leaves behind for the next one. A model-managed KV cache shows up here; so would BatchNorm's running
    statistics in training (their writes have no sequence positions)."""
    buffers = {n for n, _ in gm.named_buffers()}
    tensor_inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    out: list[StateWrite] = []
    for node in gm.graph.nodes:
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        written = [i for i, a in enumerate(t._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        for i in written:
            if i >= len(node.args):
                continue
            base = _through(node.args[i], _VIEWS)
            if not (isinstance(base, fx.Node) and base.op == "get_attr" and base.target in buffers):
                continue
            index = None
            name = _aten_name(node)
            # state per position (a cache): an indexed write, or a copy into a slice of the buffer. A whole-buffer
            # update (BatchNorm's running statistics and counter) holds no sequence and is not counted
            sliced = _aten_name(node.args[i]) in ("slice", "select", "narrow") if isinstance(node.args[i], fx.Node) \
                else False
            if name not in ("index_copy", "index_put", "scatter", "index_fill") and not (name == "copy" and sliced):
                continue
            if name == "index_copy" and len(node.args) > 2:
                index = node.args[2]
            elif name == "index_put" and len(node.args) > 1:
                index = next((x for x in node.args[1] if isinstance(x, fx.Node)), None)
            src = _through(index, _INDEX_THROUGH) if index is not None else None
            pos = src if isinstance(src, fx.Node) and src.op == "placeholder" and src in tensor_inputs else None
            out.append(StateWrite(buffer=base.target, node=node.name, positions=pos.name if pos is not None else None,
                                  positions_index=tensor_inputs.index(pos) if pos is not None else None))
    return out


def _check_graph(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Raise :class:`CaptureError` when ``gm`` and ``model`` disagree on the example inputs.

    torch.export records the path one trace takes; a model whose eager forward depends on something the trace fixed
    differently (PaliGemma's bidirectional prefix mask, built from inputs that a text-only call leaves out) would
    otherwise be captured, and then converted, as another function."""
    with torch.no_grad():
        ref = model(*args, **kwargs)
        out = gm(*args, **kwargs)
    ref_leaves, out_leaves = torch.utils._pytree.tree_leaves(ref), torch.utils._pytree.tree_leaves(out)
    ref_t = [x for x in ref_leaves if isinstance(x, torch.Tensor)]
    out_t = [x for x in out_leaves if isinstance(x, torch.Tensor)]
    name = type(model).__name__
    if len(ref_t) != len(out_t):
        raise CaptureError(
            f"the captured graph of {name} returns {len(out_t)} tensors where the model returns {len(ref_t)} on the "
            "same example inputs; turn off optional outputs (use_cache=False, output_hidden_states=False) and retry."
        )
    for i, (r, o) in enumerate(zip(ref_t, out_t)):
        if r.shape != o.shape or r.dtype != o.dtype:
            raise CaptureError(
                f"output {i} of {name}'s captured graph has shape {tuple(o.shape)} {o.dtype}, the model's "
                f"{tuple(r.shape)} {r.dtype}, on the same example inputs."
            )
        if not r.is_floating_point():
            bad = not torch.equal(r, o)
            err = "not equal"
        else:
            scale = r.abs().max().item() if r.numel() else 0.0
            diff = (r.float() - o.float()).abs().max().item() if r.numel() else 0.0
            rtol = 1e-3 if r.dtype == torch.float32 or r.dtype == torch.float64 else 2e-2
            bad = not (diff <= rtol * max(scale, 1e-6) + 1e-5)  # also catches NaN
            err = f"max |difference| {diff:.3g} against max |value| {scale:.3g}"
        if bad:
            raise CaptureError(
                f"the graph torch.export captured from {name} computes something else than the model itself on the "
                f"same example inputs (output {i}: {err}): the trace took another path than eager execution does, "
                "e.g. a mask or branch built from inputs the example call leaves out. Pass the inputs the model is "
                "really called with (example_inputs=..., example_kwargs=...), or check the model's forward for "
                "behaviour that depends on Python state. depthrewrite does not convert a graph that is not the model."
            )


_GENERIC_ADVICE = (
    "What to try: pass example inputs the model accepts (example_inputs=..., example_kwargs=...); turn off caches and "
    "optional outputs (use_cache=False, output_hidden_states=False); remove data-dependent Python control flow from "
    "forward(); or capture without dynamic shapes (dynamic=False)."
)


def _user_frame(e: BaseException) -> str | None:
    """``file:line in Class.method: source`` of the innermost frame of ``e``'s traceback (and its causes) that is
    the model's code: not torch's, not depthrewrite's, not the standard library's."""
    import os
    import sysconfig
    import traceback

    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, __import__("depthrewrite")))
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    best = None
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            f = tb.tb_frame.f_code.co_filename
            if not f.startswith(skip) and not (f.startswith(stdlib) and "site-packages" not in f) and f != "<string>":
                owner = tb.tb_frame.f_locals.get("self")
                name = tb.tb_frame.f_code.co_name
                where = f"{type(owner).__name__}.{name}" if isinstance(owner, nn.Module) else name
                line = (traceback.extract_tb(tb, limit=1)[0].line or "").strip()
                short = f.split("site-packages" + os.sep)[-1]  # torchtune/modules/kv_cache.py: the package's path
                best = f"{short}:{tb.tb_lineno} in {where}" + (f": `{line}`" if line else "")
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return best


#: what to do instead of capturing a framework's own KV cache, by the cache module's top-level package
_CACHE_ADVICE = {
    "torchtune": ("Call without it, e.g. within torchtune.modules.common_utils.disable_kv_cache(model), or remove it "
                  "with delete_kv_caches(model); torchtune's generate() then decodes without a cache."),
    "olmo_core": ("Generate with GenerationConfig(use_cache=False) (TransformerGenerationModule recomputes the "
                  "sequence and the converted model decodes exactly), or remove the cache with the generation "
                  "module's free_inference_cache()."),
    "": "Remove the cache (call the model without it) and recompute the sequence each step.",
}


def kv_cache_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of ``model`` that hold a KV cache in their own buffers: a module with both a ``k_cache`` and a
    ``v_cache`` buffer (torchtune's ``KVCache``, OLMo-core's ``KVCacheManager``), as ``(path, module)``."""
    found = []
    for path, mod in model.named_modules():
        own = {n for n, _ in mod.named_buffers(recurse=False)}
        if {"k_cache", "v_cache"} <= own:
            found.append((path, mod))
    return found


def _explain_export_error(model: nn.Module, e: BaseException, args: tuple, kwargs: dict) -> str:
    """The CaptureError text for export's exception ``e``: the likely cause first (a float tensor where token ids
    belong; a data-dependent check in the model's code, with its place), then export's own first line."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    where = _user_frame(e)
    at = f" (at {where})" if where else ""
    name = type(model).__name__
    if "'indices'" in text and ("Long" in text or "Int" in text):
        floats = [k for k, v in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]
                  if isinstance(v, torch.Tensor) and v.is_floating_point()]
        which = f"the floating-point input {', '.join(floats)}" if floats else "a floating-point tensor"
        return (f"torch.export could not capture {name}: {which} reaches an embedding lookup, which takes integer "
                f"token ids{at}. Pass token ids as a torch.long (or int) tensor. (export: {type(e).__name__}: {first})")
    if "data-dependent" in text or "DataDependent" in type(e).__name__:
        caches = kv_cache_modules(model)
        if caches:
            path, mod = caches[0]
            of = f", one of {len(caches)}" if len(caches) > 1 else ""
            cause = (f"the KV cache the model keeps in its own modules, {path} ({type(mod).__name__}{of}): its write "
                     "positions come from the cache's own buffers, so each call would need another graph. "
                     + _CACHE_ADVICE.get(type(mod).__module__.split(".")[0], _CACHE_ADVICE[""]))
        else:
            cause = ("state the model keeps across calls (a KV cache set up inside the model), or an input check. "
                     "Remove the check, or call the model in a way that does not reach it.")
        return (f"torch.export could not capture {name}: the model's code branches on a tensor's value (an `if`, "
                f"`assert` or `.item()` on data){at}, which a graph for every input cannot follow. The likely cause "
                f"is {cause} (export: {type(e).__name__}: {first})")
    m = re.search(r"Unsupported input type <class '([\w.]+)'>", text)
    if m:
        cls = m.group(1).rsplit(".", 1)[-1]
        found = [k for k, v in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]
                 if any(type(x).__name__ == cls for x in torch.utils._pytree.tree_leaves(v))]
        which = f" ({', '.join(found)})" if found else ""
        hint = (" A FlexAttention BlockMask: build it inside the model's forward, or convert the model with SDPA "
                "attention (torchtitan: each layer's attention.inner_attention = ScaledDotProductAttention.Config(); "
                "docs/frameworks/torchtitan.md)." if cls == "BlockMask" else "")
        return (f"torch.export could not capture {name}: an input{which} is a {cls}, which torch.export does not take "
                f"as an input (only tensors, numbers and containers of them). Pass it in another form, or let the "
                f"model build it from plain inputs.{hint} (export: {type(e).__name__}: {first})")
    return f"torch.export could not capture {name}: {type(e).__name__}: {first}{at}\n{_GENERIC_ADVICE}"


def drop_fake_state(model: nn.Module) -> list[str]:
    """Remove the fake tensors ``torch.export`` left in Python-side state of the model's modules and return their
    paths. A cache a module fills on first use (OLMo-core's RoPE sin/cos tables in a plain dict) is filled during the
    trace with export's fake tensors; left there, every later eager call would compute with them. Dropped, the cache
    is filled again with real tensors on the next call. An entry (module attribute, dict value, list item) that is a
    fake tensor or a list / tuple of tensors holding one is dropped whole (a list item: the list is emptied, as a cache
    list is refilled); fake tensors inside anything else cannot be restored: :class:`CaptureError`."""
    from torch._subclasses.fake_tensor import FakeTensor

    dropped: list[str] = []
    seen: set[int] = set()

    def fake(v: Any) -> bool:
        """v is a fake tensor, or a (nested) list / tuple of tensors holding one."""
        if isinstance(v, FakeTensor):
            return True
        if isinstance(v, (list, tuple)) and v:
            leaves = torch.utils._pytree.tree_leaves(v)
            return all(isinstance(x, torch.Tensor) for x in leaves) and any(isinstance(x, FakeTensor) for x in leaves)
        return False

    def visit(obj: Any, path: str, depth: int) -> None:
        if depth > 6 or id(obj) in seen or isinstance(obj, (nn.Module, torch.Tensor, type, str, bytes)):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k in list(obj):
                if fake(obj[k]):
                    del obj[k]
                    dropped.append(f"{path}[{k!r}]")
                else:
                    visit(obj[k], f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, list) and any(fake(v) for v in obj):
            obj.clear()
            dropped.append(f"{path}[:]")
        elif isinstance(obj, (list, tuple, set)):
            for i, v in enumerate(obj):
                if fake(v):
                    raise CaptureError(
                        f"torch.export left a fake tensor in {path}[{i}] (inside a {type(obj).__name__}, which cannot "
                        "be emptied): a Python-side cache the model filled while it was traced. Every later call would "
                        "compute with it. Keep such caches in a dict, a list or a buffer, or fill them before converting.")
                visit(v, f"{path}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__") and not callable(obj):
            visit(vars(obj), path, depth + 1)

    for name, mod in model.named_modules():
        for k, v in list(vars(mod).items()):
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            where = f"{name}.{k}" if name else k
            if isinstance(v, list) and fake(v):
                v.clear()
                dropped.append(f"{where}[:]")
            elif fake(v):
                delattr(mod, k)
                dropped.append(where)
            else:
                visit(v, where, 0)
    return dropped


class _WithoutPartialGraphs(io.TextIOBase):
    """sys.stderr while torch.export runs: torch.export prints the partial graph of a failed trace (the whole model,
    hundreds of lines) to stderr before raising, once per attempt; the CaptureError says what failed. Such a write
    goes to this module's debug log instead; everything else passes through."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def write(self, text: str) -> int:
        if "def forward(self" in text[:400]:
            log.debug("torch.export's partial graph of a failed trace:\n%s", text)
            return len(text)
        return self.real.write(text)

    def flush(self) -> None:
        self.real.flush()


@contextlib.contextmanager
def _quiet_partial_graphs() -> Iterator[None]:
    real = sys.stderr
    sys.stderr = _WithoutPartialGraphs(real)
    try:
        yield
    finally:
        sys.stderr = real


def capture(
    model: nn.Module,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    *,
    dynamic: bool = True,
    check: bool = True,
    keep_cache: bool = False,
    module_calls: bool = False,
    live: tuple[str, ...] = (),
) -> fx.GraphModule:
    """Capture ``model`` as an FX ``GraphModule`` with ``torch.export`` (non-strict, training IR).

    Args:
        model (nn.Module): the model; it is not modified.
        example_inputs (tuple, optional): positional example inputs. Built for HF and timm models when None.
        example_kwargs (dict, optional): keyword example inputs.
        dynamic (bool): make batch and sequence dimensions dynamic. Default: True.
        check (bool): when the model is in eval mode, run the captured graph and the model on the example inputs
            and raise :class:`CaptureError` if they disagree (export traced another path than eager runs). Default:
            True. (Not done for a call that passes a KV cache, or one that writes into the model's buffers: the model
            would update its cache.)
        keep_cache (bool): capture with the model's KV cache as configured (the call passes ``use_cache=True`` or a
            ``past_key_values`` cache; a ``DynamicCache`` is taken and returned as tensors). Default: False, which
            captures with ``use_cache`` off in every config that turns it on.
        module_calls (bool): also record the call signature of every ``nn.Linear`` and ``nn.Embedding`` (export's
            ``preserve_module_call_signature``; a path export refuses is dropped and the export retried) and stamp
            every node with its capture name and arguments, for the module-call lowering
            (:mod:`depthrewrite.passes.lower.module_calls`). Default: False (opt-in, ``convert(..., module_calls=True)``).
        live (tuple of str): with ``module_calls``, the paths that must run as live modules (their hooks or a forward
            set on the instance were taken out for the capture): a module taking a FlexAttention ``BlockMask`` is
            called only when it is, or holds, one of them (or tensor-parallel parameters).

    Returns:
        The unlifted ``GraphModule`` (parameters as ``get_attr`` with their original names). Its
        ``meta["depthrewrite_inputs"]`` keeps the example ``(args, kwargs)`` used.
    """
    if isinstance(model, fx.GraphModule) and example_inputs is None and example_kwargs is None:
        return model
    if example_inputs is None and example_kwargs is None:
        args, kwargs = example_inputs_for(model)
    else:
        if isinstance(example_inputs, torch.Tensor):
            args = (example_inputs,)
        else:
            args = tuple(example_inputs) if example_inputs is not None else ()
        kwargs = dict(example_kwargs or {})
    passes_cache = any(is_cache(x) for x in (*args, *kwargs.values()))
    if keep_cache or passes_cache:
        _cache_support(args, kwargs)
    register_block_mask_for((*args, *kwargs.values()))
    args, kwargs, copied = unalias_inputs(args, kwargs)
    if copied:
        log.info("capture: example inputs shared storage; copied %s so each stays its own graph input", ", ".join(copied))
    try:
        dyn = _dynamic_shapes(model, args, kwargs) if dynamic else None
    except TypeError as e:  # the inputs do not fit forward's signature
        raise CaptureError(
            f"the example inputs do not fit {type(model).__name__}.forward: {e}. Pass example_inputs / "
            "example_kwargs the way you would call the model."
        ) from e
    log.info("capturing %s with torch.export (non-strict)", type(model).__name__)
    # A KV cache object is not a tensor output export can return: capture with the cache off in every config that
    # turns it on (a multimodal wrapper keeps it in its text_config), and restore them afterwards.
    cache = _cache_configs(model) if _is_hf(model) and not keep_cache else []
    try:
        for c in cache:
            c.use_cache = False
        # export warns for every dynamic dimension it specialises (a batch or sequence of 1): expected here, since a
        # call structure gets a graph per specialisation (depthrewrite.runtime.entries)
        quiet = logging.getLogger("torch._export.non_strict_utils")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with _quiet_partial_graphs(), capturing_flex():
                if module_calls:
                    from .passes.lower.module_calls import export_with_signatures

                    ep = export_with_signatures(model, args, kwargs, dyn, live)
                else:
                    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dyn, strict=False)
        finally:
            quiet.setLevel(level)
    except Exception as e:  # torch.export raises many types; all of them mean the same to our user
        raise CaptureError(_explain_export_error(model, e, args, kwargs)) from e
    else:
        dropped = drop_fake_state(model)
        if dropped:
            log.info("capture: dropped fake tensors export left in %s", ", ".join(dropped[:4]))
        gm = ep.module()
        retarget_flex(gm)  # FlexAttention's operator as a call Dynamo can trace too
        # eval mode only: dropout would make the two calls differ; never where the call writes state into the model
        # (a KV cache in its buffers): running it twice more would write it twice more
        if check and not model.training and not passes_cache and not state_writes(gm):
            _check_graph(model, gm, args, kwargs)
    finally:
        for c in cache:
            c.use_cache = True
    if module_calls:
        from .passes.lower.module_calls import stamp

        stamp(gm, ep)
    gm.meta["depthrewrite_inputs"] = (args, kwargs)
    gm.meta["depthrewrite_model_class"] = type(model).__name__
    return gm
