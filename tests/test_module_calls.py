"""convert(..., module_calls=True) (issue #24, docs/design/module-calls.md, steps 1-2): every nn.Linear /
nn.Embedding the rewrite leaves intact runs as a call of the live module inside the block programs and the runner.
Compared with the same conversion without module calls (module_calls=False); module_calls=None (the default) is
the same with a traced hook instead of a ModuleCallError where a call cannot be kept."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.testing import GPT, Block, nanogpt

aten = torch.ops.aten
SCHEMES = ["attnres", "msar", "mhc", "moda"]


def _llama():
    torch.manual_seed(0)
    m = hf_model("llama", layers=2).eval()
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return m, ((), {"input_ids": ids}), "model.layers.0.self_attn.q_proj"


def _nanogpt():
    m = nanogpt(2).eval()
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return m, ((ids,), {}), "transformer.h.0.attn.c_attn"


MODELS = {"llama": _llama, "nanogpt": _nanogpt}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _pair(model: str, scheme: str):
    """(off, on, call inputs, hooked path): the same model converted without and with module calls, same params."""
    m, (args, kwargs), hooked = MODELS[model]()
    m2 = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off = dr.convert(m, scheme, example_inputs=args or None, example_kwargs=kwargs or None, module_calls=False)
        on = dr.convert(m2, scheme, example_inputs=args or None, example_kwargs=kwargs or None, module_calls=True)
    on.load_state_dict(off.state_dict())
    return off, on, (args, kwargs), hooked


_CACHE: dict = {}


def pair(model: str, scheme: str):
    key = (model, scheme)
    if key not in _CACHE:
        _CACHE.clear()  # one pair alive at a time
        _CACHE[key] = _pair(model, scheme)
    return _CACHE[key]


def _called(path: str, called) -> bool:
    """Whether the module at ``path`` runs as a live module: called itself or inside a called module."""
    return any(path == c or path.startswith(c + ".") for c in called)


def _runner(c):
    entries = c.__dict__["_depthrewrite"].entries()
    assert entries and entries[0].runner is not None
    return entries[0].runner


def _original_linears(gm_graph) -> list[str]:
    """aten.linear / aten.t / aten.mm / aten.embedding nodes reading a weight by get_attr (an original module's: the
    new parameters reach the programs as inputs, and MoDA's own projections read model.depthrewrite)."""
    out = []
    for n in gm_graph.nodes:
        if n.op == "call_function" and n.target in (aten.linear.default, aten.t.default, aten.mm.default,
                                                      aten.embedding.default):
            if any(a.op == "get_attr" and not str(a.target).startswith("depthrewrite.") for a in n.all_input_nodes):
                out.append(n.name)
    return out


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_equal_and_modules_called(model, scheme):
    off, on, (args, kwargs), hooked = pair(model, scheme)
    with torch.no_grad():
        a, b = _logits(off(*args, **kwargs)), _logits(on(*args, **kwargs))
    assert (a - b).abs().max().item() <= 1e-6
    runner = _runner(on)
    calls = runner.meta["depthrewrite_module_calls"]
    assert _called(hooked, calls["called"]), calls
    assert "depthrewrite_module_calls" not in _runner(off).meta
    assert not _original_linears(runner.graph)
    for prog in runner.programs.values():
        assert not _original_linears(prog.graph), prog.module.code
        assert any(n.op == "call_module" for n in prog.graph.nodes)
    # the off path's programs run the projections as aten ops
    assert any(_original_linears(p.graph) for p in _runner(off).programs.values())


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.filterwarnings("ignore:depthrewrite. the hook")
def test_forward_hook_fires_on_every_call(model, scheme):
    off, on, (args, kwargs), hooked = pair(model, scheme)
    counts = {"on": 0, "off": 0}
    handles = []
    for name, c in (("on", on), ("off", off)):
        mod = c.get_submodule(hooked)
        handles.append(mod.register_forward_hook(lambda *_, k=name: counts.__setitem__(k, counts[k] + 1)))
    with torch.no_grad():
        on(*args, **kwargs)
    captures = on.__dict__["_depthrewrite"].captures
    try:
        with torch.no_grad():
            for c in (on, off):
                c(*args, **kwargs)  # off: a hook changes the module tree, recaptured (and the hook traced)
            counts.update(on=0, off=0)
            for _ in range(3):
                on(*args, **kwargs)
                off(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    assert counts["on"] == 3
    assert counts["off"] == 0  # today's graphs inline the projection: the hook never runs
    assert on.__dict__["_depthrewrite"].captures == captures  # a hook on a called module needs no recapture


class LinearOnly(torch.Tensor):
    """A torchao-like weight: implements F.linear (torch function) and aten.linear / detach (dispatch) only."""

    seen: list = []

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self._data = data

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            cls.seen.append("F.linear")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return F.linear(args[0], args[1]._data, b)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.detach.default:
            return LinearOnly(args[0]._data.detach())
        if func is aten.linear.default:
            return aten.linear.default(args[0], args[1]._data, *args[2:])
        raise NotImplementedError(f"LinearOnly does not implement {func}")


def _block_linears(model: nn.Module, blocks) -> list[nn.Linear]:
    return [m for p in blocks for m in model.get_submodule(p).modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_weight_subclass_with_only_f_linear(model, scheme):
    off, on, (args, kwargs), _ = pair(model, scheme)
    with torch.no_grad():
        ref = _logits(on(*args, **kwargs))
    blocks = on.__dict__["_depthrewrite"].blocks
    linears = _block_linears(on, blocks)
    saved = [lin.weight for lin in linears]
    try:
        for lin in linears:
            lin.weight = nn.Parameter(LinearOnly(lin.weight.detach()), requires_grad=False)
        LinearOnly.seen.clear()
        captures = on.__dict__["_depthrewrite"].captures
        with torch.no_grad():  # the existing graphs, no recapture: the runner calls the live modules
            out = on(*args, **kwargs)
        assert on.__dict__["_depthrewrite"].captures == captures
        assert (_logits(out) - ref).abs().max().item() <= 1e-6
        assert len(LinearOnly.seen) >= len(linears)
    finally:
        for lin, w in zip(linears, saved):
            lin.weight = w


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_training_gradients_equal(model, scheme):
    off, on, (args, kwargs), _ = pair(model, scheme)
    grads = {}
    for name, c in (("off", off), ("on", on)):
        c.train()
        c.zero_grad(set_to_none=True)
        try:
            _logits(c(*args, **kwargs)).float().pow(2).mean().backward()
        finally:
            c.eval()
        grads[name] = {k: p.grad.clone() for k, p in c.named_parameters() if p.grad is not None}
        c.zero_grad(set_to_none=True)
    assert grads["on"].keys() == grads["off"].keys() and grads["on"]
    for k, g in grads["off"].items():
        assert (grads["on"][k] - g).abs().max().item() <= 1e-6, k
    assert "depthrewrite_module_calls" in _runner_of_mode(on, True).meta


def _runner_of_mode(c, training: bool):
    e = next(e for e in c.__dict__["_depthrewrite"].entries() if e.module.training == training)
    return e.runner


def test_on_by_default():
    import inspect

    assert inspect.signature(dr.convert).parameters["module_calls"].default is None


def test_off_captures_no_signatures():
    from depthrewrite.passes.lower.module_calls import SIGNATURES_META

    off, _, _, _ = pair("nanogpt", "attnres")
    st = off.__dict__["_depthrewrite"]
    assert st.module_calls is False
    entry = st.entries()[0]
    assert SIGNATURES_META not in entry.module.meta
    assert all("depthrewrite_capture" not in n.meta for n in entry.module.graph.nodes)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_signatures_leave_the_captured_graph_as_it_was(model):
    import collections

    from depthrewrite.capture import capture
    from depthrewrite.passes.lower.module_calls import SIGNATURES_META

    m, (args, kwargs), hooked = MODELS[model]()
    plain = capture(m, args or None, kwargs or None)
    signed = capture(m, args or None, kwargs or None, module_calls=True)

    def ops(gm):
        return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

    assert ops(plain) == ops(signed)
    info = signed.meta[SIGNATURES_META]
    assert hooked in info.signatures and not info.dropped
    assert all("depthrewrite_capture" in n.meta for n in signed.graph.nodes)


class _SizedLinear(nn.Linear):
    def forward(self, x, n):  # n: the sequence length, a SymInt under dynamic shapes
        return super().forward(x)[:, :n]


def test_a_path_export_refuses_is_dropped_and_inlined():
    from depthrewrite.testing import MLP

    class SizedMLP(MLP):
        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x, x.shape[1]))))

    m, (args, _), _ = _nanogpt()
    m.transformer.h[0].mlp.__class__ = SizedMLP
    m.transformer.h[0].mlp.c_fc.__class__ = _SizedLinear
    m2 = copy.deepcopy(m)
    off = dr.convert(m, "attnres", example_inputs=args, module_calls=False)
    on = dr.convert(m2, "attnres", example_inputs=args, module_calls=True)
    on.load_state_dict(off.state_dict())
    with torch.no_grad():
        assert (off(*args) - on(*args)).abs().max().item() <= 1e-6
    calls = _runner(on).meta["depthrewrite_module_calls"]
    inlined = dict(calls["inlined"])
    assert "transformer.h.0.mlp.c_fc" in inlined and "flattened inputs" in inlined["transformer.h.0.mlp.c_fc"]
    assert "transformer.h.0.mlp.c_fc" not in calls["called"]
    assert all(_called(p, calls["called"]) for p in ("transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_fc", "lm_head"))


def test_a_hook_on_a_module_the_rewrite_changes_is_refused_not_dropped():
    """With module calls the capture takes run-time hooks out of every module it may call; a hooked module whose call
    stays inlined (MoDA changes the attention) would never run its hook: ConfigError naming it and why."""
    from depthrewrite.errors import ConfigError

    m, (args, kwargs), _ = _llama()
    conv = dr.convert(m, "moda", example_kwargs=kwargs, module_calls=True)
    note = next(n for n in conv.report().notes if n.startswith("module calls:"))
    assert "inlined: model.layers.0.self_attn (" in note and "model.layers.1.self_attn (region changed" in note
    seen = []
    conv.model.layers[1].self_attn.register_forward_hook(lambda *_: seen.append(1))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn has 1 hook\(s\) that fire at run time, but "
                                          r"its call stays inlined \(region changed"):
        conv(**kwargs)


def test_a_hook_on_a_called_sublayer_fires_at_run_time_without_the_traced_warning():
    m, (args, kwargs), _ = _llama()
    conv = dr.convert(m, "attnres", example_kwargs=kwargs, module_calls=True)
    seen = []
    conv.model.layers[0].mlp.register_forward_hook(lambda mod, i, out: seen.append(out.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the hook ... is traced" warning: the mlp is called
        with torch.no_grad():
            for _ in range(3):
                conv(**kwargs)
    assert len(seen) == 3


def test_auto_mode_traces_a_hook_it_cannot_keep_with_a_warning():
    """module_calls=None: module calls on, and a hooked module whose call stays inlined (MoDA changes the attention)
    is captured again without module calls, its hook traced into the graph with the usual warning, not refused."""
    from depthrewrite.errors import ModuleCallError

    m, (args, kwargs), _ = _llama()
    ref = copy.deepcopy(m)
    conv = dr.convert(m, "moda", example_kwargs=kwargs, module_calls=None)
    seen = []
    conv.model.layers[1].self_attn.register_forward_hook(lambda *_: seen.append(1))
    with pytest.warns(UserWarning, match="traced"):
        with torch.no_grad():
            conv(**kwargs)
    assert seen  # ran while tracing: the hook is in the graph
    strict = dr.convert(ref, "moda", example_kwargs=kwargs, module_calls=True)
    strict.model.layers[1].self_attn.register_forward_hook(lambda *_: None)
    with pytest.raises(ModuleCallError):
        strict(**kwargs)


def test_a_forward_set_on_an_inlined_module_is_refused():
    """A forward set on the instance of a module whose call the scheme cannot keep (MoDA's attention) would be
    skipped by the inlined graph: a ModuleCallError naming it. Only torchtitan's own redistribution wrapper (its
    ``partial_dtensor`` tensor parallelism, reproduced at the live calls around the inlined module) is let through
    (tests/frameworks/test_fsdp_recipes.py: torchtitan-tp-*-moda)."""
    from depthrewrite.errors import ModuleCallError
    from depthrewrite.passes.lower.module_calls import redistributes_only

    m, (args, kwargs), _ = _llama()
    conv = dr.convert(m, "moda", example_kwargs=kwargs, module_calls=True)
    attn = conv.model.layers[1].self_attn
    cls_forward = type(attn).forward

    def forward_with_redistribution(*a, **k):  # a look-alike, not torchtitan's
        return cls_forward(attn, *a, **k)

    attn.forward = forward_with_redistribution
    assert not redistributes_only(attn)
    with pytest.raises(ModuleCallError, match="layers.1.self_attn has its forward replaced on the instance"):
        conv(**kwargs)


class _Fp32MLPBlock(Block):
    """A nanoGPT block that computes its MLP sublayer inside ``torch.autocast(dtype=float32)``, as torchtitan's MoE
    router computes its gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        with torch.autocast(device_type=x.device.type, dtype=torch.float32):
            y = self.mlp(self.ln_2(x))
        return x + y


def test_a_module_called_inside_an_autocast_block_is_called_inside_it():
    """Pre-dispatch export moves every ``torch.autocast`` block into a higher-order op, whose module-call markers it
    never collects: the capture keeps a block holding a call as its enter/exit nodes instead, so the MLP is called
    live (a hook fires on every call) between them, and an outer autocast at run time meets the block as in the
    original (the MLP stays float32 on a CPU; outside the block it would run in bfloat16)."""
    m, (args, _), _ = _nanogpt()
    for blk in m.transformer.h:
        blk.__class__ = _Fp32MLPBlock
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(m, "attnres", example_inputs=args, module_calls=True)
        path = "transformer.h.1.mlp"
        assert _called(path, _runner(conv).meta["depthrewrite_module_calls"]["called"])
        seen = []
        conv.get_submodule(path).register_forward_hook(lambda mod, i, out: seen.append(out.dtype))
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(_logits(conv(*args)), _logits(ref(*args)))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got, want = _logits(conv(*args)), _logits(ref(*args))
    assert seen == [torch.float32] * 4
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)


class _Fp32HeadGPT(GPT):
    """nanoGPT computing its head with autocast off, as a model keeping float32 logits does."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        with torch.autocast("cpu", enabled=False):
            return self.lm_head(self.transformer.ln_f(x).float())


class _AutocastBlocksGPT(GPT):
    """nanoGPT running its blocks inside ``torch.autocast(dtype=bfloat16)``."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for block in self.transformer.h:
                x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_an_autocast_block_in_the_models_own_forward_keeps_its_place():
    """An autocast block of the model's forward, outside the blocks, runs where it ran: the head under
    ``autocast(enabled=False)`` after the last block (float32 logits under an outer bfloat16 autocast, as the
    original; by their data alone its enter/exit nodes would run before the first block, around nothing). Blocks run
    inside one (``_AutocastBlocksGPT``) cannot be split out of it: the flat graph runs in its order, the report says
    why, and a hook on a module inside it is a ModuleCallError (the flat graph calls no module), not dropped."""
    from depthrewrite.errors import ModuleCallError

    m, (args, _), _ = _nanogpt()
    m.__class__ = _Fp32HeadGPT
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(m, "attnres", example_inputs=args, module_calls=True)
        st = conv.__dict__["_depthrewrite"]
        assert st.blocks and _called("lm_head", _runner(conv).meta["depthrewrite_module_calls"]["called"])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = conv(*args), ref(*args)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)

    m, (args, _), _ = _nanogpt()
    m.__class__ = _AutocastBlocksGPT
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(m, "mhc", example_inputs=args, module_calls=True, alpha_init=0.0)
        st = conv.__dict__["_depthrewrite"]
        assert st.blocks is None and "torch.autocast block" in st.blocks_note
        with torch.no_grad():
            got, want = conv(*args), ref(*args)
            plain = copy.deepcopy(ref)
            plain.__class__ = GPT
            without = plain(*args)
        # inside the autocast block, as the original (rounding in bfloat16), not outside it
        assert (got - want).abs().max() < 0.2 * (without - want).abs().max()
        conv.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *a: None)
        with pytest.raises(ModuleCallError, match="c_fc has 1 hook"):
            conv(*args)


# ---- modules the graphs call are opaque: what happens inside them needs no recapture --------------------------------


def _lora(model: nn.Module, seed: int):
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj", "c_attn", "c_fc"],
                          init_lora_weights=False)  # random A and B: the LoRA layers change the output
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lora_inside_called_modules_needs_no_recapture(scheme):
    """peft replaces q_proj / v_proj / down_proj by LoRA layers: the graphs call those paths live, so the converted
    model keeps its graphs and runs the LoRA layers; a conversion that inlines them (module_calls=False) recaptures.
    Both give the same logits."""
    off, on, (args, kwargs), _ = pair("llama", scheme)
    off, on = copy.deepcopy(off), copy.deepcopy(on)  # the shared pair stays unwrapped
    with torch.no_grad():
        before = _logits(on(*args, **kwargs))
        off(*args, **kwargs)
    st_on, st_off = on.__dict__["_depthrewrite"], off.__dict__["_depthrewrite"]
    captures = st_on.captures, st_off.captures
    p_on, p_off = _lora(on, 3), _lora(off, 3)
    p_off.load_state_dict({k: v for k, v in p_on.state_dict().items() if "lora_" in k}, strict=False)
    with torch.no_grad():
        a, b = _logits(p_on(*args, **kwargs)), _logits(p_off(*args, **kwargs))
    assert (a - before).abs().max() > 1e-3  # the LoRA layers run
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert st_on.captures == captures[0] and st_on.recaptures == 0
    assert st_off.captures > captures[1]  # its graphs inline the projections


def test_flop_counter_counts_per_module_as_the_original():
    """FlopCounterMode (a global module hook and a dispatch mode) counts every module the graphs call as in the
    original: each attention, MLP, projection and the head. The blocks hold the scheme's depth ops too (counted when
    depthrewrite's flop formulas are registered). The module holding the rewritten chain (LlamaModel) runs as the
    converted graph's glue, and the global hooks run for it where it starts and ends, so it is counted too; the
    graph module running it is never seen. A capture inside the mode is not counted (it traces fake tensors)."""
    from torch.utils.flop_counter import FlopCounterMode

    m, (_, kwargs), _ = _llama()
    ref = copy.deepcopy(m)
    conv = dr.convert(m, "attnres", example_kwargs=kwargs)

    def count(model):
        with FlopCounterMode(display=False) as fc:
            model(**kwargs)
        return fc.get_total_flops(), {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}

    conv.train(), ref.train()  # a new call structure: captured inside the mode
    captures = conv.__dict__["_depthrewrite"].captures
    first = count(conv)
    assert conv.__dict__["_depthrewrite"].captures == captures + 1
    again, orig = count(conv), count(ref)
    assert first == again and isinstance(first[0], int)  # the capture's fake tensors were not counted
    assert again[0] >= orig[0]
    per, per_ref = again[1], orig[1]
    inside = {k: v for k, v in per_ref.items() if ".layers.0." in k or ".layers.1." in k or k.endswith("lm_head")}
    assert "LlamaForCausalLM.model.layers.0.self_attn.q_proj" in inside and len(inside) == 19
    assert {k: per.get(k) for k in inside} == inside
    assert set(per) == set(per_ref)  # the same modules, LlamaModel included, and no graph module
    assert per["LlamaForCausalLM.model"] >= per_ref["LlamaForCausalLM.model"]


def test_module_tracker_sees_the_called_modules():
    from torch.utils.module_tracker import ModuleTracker

    m, (_, kwargs), _ = _llama()
    ref = copy.deepcopy(m)
    conv = dr.convert(m, "msar", example_kwargs=kwargs)

    def parents(model):
        seen = []
        with ModuleTracker() as mt:
            h = model.get_submodule("model.layers.1.mlp.up_proj").register_forward_hook(
                lambda *_: seen.append(set(mt.parents)))
            try:
                with torch.no_grad():
                    model(**kwargs)
            finally:
                h.remove()
        return seen

    got, want = parents(conv), parents(ref)
    assert len(got) == len(want) == 1
    assert got == want  # the chain's module (LlamaModel) too: the global hooks run where its glue starts and ends
    assert {"LlamaForCausalLM.model", "LlamaForCausalLM.model.layers.1",
            "LlamaForCausalLM.model.layers.1.mlp"} <= got[0]


def test_decoding_steps_call_the_modules(scheme="attnres"):
    """Under the default, the graphs of calls continuing a KV cache (every decoding step of generate()) call the
    modules too: a hook on q_proj fires once per step as in the original, the generated tokens are the original's,
    and a global module hook (FlopCounterMode) runs rather than being refused."""
    from torch.utils.flop_counter import FlopCounterMode

    m, (_, kwargs), path = _llama()
    ref = copy.deepcopy(m)
    conv = dr.convert(m, scheme, example_kwargs=kwargs)
    ids = kwargs["input_ids"][:, :6]
    gen = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)

    def fires(model):
        seen = []
        h = model.get_submodule(path).register_forward_hook(lambda mod, i, out: seen.append(out.shape[1]))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "the hook ... is traced" warning
                out = model.generate(ids, **gen)
        finally:
            h.remove()
        return out, seen

    (got, seen), (want, seen_ref) = fires(conv), fires(ref)
    assert torch.equal(got, want)
    assert seen == seen_ref == [6, 1, 1, 1]
    assert all(e.module_calls for e in conv.__dict__["_depthrewrite"].entries())
    with FlopCounterMode(display=False) as fc:
        assert torch.equal(conv.generate(ids, **gen), want)
    assert fc.get_total_flops() > 0


def _titan_wrapped(mod: nn.Module, dims) -> nn.Module:
    """``mod`` with a forward set on the instance shaped like torchtitan's ``Module.parallelize`` wrapper."""
    def make(parallel_dims):
        def forward_with_redistribution(*a, **k):
            return type(mod).forward(mod, *a, **k) if parallel_dims is not None else None
        return forward_with_redistribution

    fn = make(dims)
    fn.__module__ = "torchtitan.protocols.module"
    fn.__qualname__ = "Module.parallelize.<locals>.forward_with_redistribution"
    mod.forward = fn
    return mod


def test_torchtitans_spmd_wrappers_without_tensor_parallelism_are_not_sharded():
    """torchtitan wraps every module's forward for FSDP-only runs too (``parallelize_llama`` with tp=1): with no tp
    mesh, nothing is a local shard (no stand-ins at capture, nothing to gather or refuse) instead of an error."""
    from depthrewrite.passes.lower import module_calls as mc

    class Dims:
        spmd_backend = "spmd_types"

        def get_optional_mesh(self, *_a, **_k):
            return None

    class Config:
        state_shardings = {"weight": object()}  # never resolved without a tp mesh
        in_src_shardings = in_dst_shardings = out_src_shardings = out_dst_shardings = None

    lin = _titan_wrapped(nn.Linear(4, 4), Dims())
    lin._sharding_config = Config()
    assert mc.redistributes_only(lin)
    assert mc._spmd_state(lin) is None and mc._spmd_sharded_below(lin) is None and mc._pending_on_tp(lin) == []
    undo: list = []
    mc._whole_stand_ins(lin, undo)
    assert not undo and lin.weight.shape == (4, 4)
    assert not mc._titan_sequence_sharded(lin)
