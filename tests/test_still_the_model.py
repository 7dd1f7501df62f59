"""A converted model is still the model (issue #14): in-place conversion keeping the original's class and methods, any
call the original accepts (a graph per call structure), generate() with a KV cache, save/load, peft LoRA.

Conversions are shared per module (one per model and scheme) and every call structure captures once per conversion.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import HF_TYPES, hf_model
from depthrewrite.errors import ConfigError
from depthrewrite.passes.rewrite import scheme as scheme_record
from depthrewrite.testing import nanogpt

SCHEMES = ["attnres", "msar", "mhc", "moda"]
IDS = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def _exact(name: str) -> dict:
    return dict(scheme_record(name).exact)


def _randomise(model: torch.nn.Module, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.depthrewrite.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


_PAIRS: dict = {}


def _pair(name: str, scheme: str):
    """(original, converted copy with the exact-at-init options), built once per module."""
    key = (name, scheme)
    if key not in _PAIRS:
        torch.manual_seed(0)
        model = hf_model(name, layers=2).eval()
        _PAIRS[key] = (model, dr.convert(model, scheme, inplace=False, **_exact(scheme)))
    return _PAIRS[key]


# ---- 1. the same object, its class, its methods -------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_convert_is_in_place_and_keeps_the_class(scheme):
    model = hf_model("llama", layers=2).eval()
    cls = type(model)
    conv = dr.convert(model, scheme)
    assert conv is model and isinstance(conv, cls) and type(conv).__name__ == cls.__name__
    assert dr.is_converted(conv) and not dr.is_converted(hf_model("llama", layers=2))
    assert conv.config.model_type == "llama" and conv.generation_config is not None
    assert conv.get_input_embeddings() is conv.model.embed_tokens
    assert conv.num_parameters() == sum(p.numel() for p in conv.parameters())
    assert "depthrewrite" in repr(conv)
    with pytest.raises(ConfigError, match="already converted"):
        dr.convert(conv, "msar")


def test_inplace_false_shares_nothing():
    model = hf_model("llama", layers=2).eval()
    ref = model(IDS).logits
    conv = dr.convert(model, "attnres", inplace=False)
    assert not dr.is_converted(model) and conv is not model
    assert not {id(p) for p in model.parameters()} & {id(p) for p in conv.parameters()}
    conv.to(torch.bfloat16)
    assert next(model.parameters()).dtype == torch.float32
    torch.testing.assert_close(model(IDS).logits, ref)


def test_hand_written_model_keeps_its_methods():
    torch.manual_seed(0)
    model = nanogpt(n_layer=2, n_embd=32)
    ref = model.generate(IDS[:, :4] % 64, max_new_tokens=3)
    conv = dr.convert(model, "attnres")
    assert torch.equal(conv.generate(IDS[:, :4] % 64, max_new_tokens=3), ref)
    opt = conv.configure_optimizers()
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(conv.parameters()))
    conv(IDS % 64).float().pow(2).mean().backward()
    opt.step()


# ---- 2. any call the original accepts -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_any_call_structure(name, scheme):
    model, conv = _pair(name, scheme)
    mask = torch.ones_like(IDS)
    calls = [
        dict(input_ids=IDS),
        dict(input_ids=IDS, labels=IDS),
        dict(input_ids=IDS, attention_mask=mask),
        dict(input_ids=IDS, output_hidden_states=True),
        dict(input_ids=IDS[:1, :5]),  # batch 1, another length: export's dynamic dims assume >= 2
    ]
    for kw in calls:
        want, got = model(**kw), conv(**kw)
        atol = 1e-4 if scheme != "mhc" else 2e-3  # mHC's default alpha_init is exact; Sinkhorn rounding
        torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=1e-4)
        if "labels" in kw:
            torch.testing.assert_close(got.loss, want.loss, atol=atol, rtol=1e-4)
        if kw.get("output_hidden_states"):
            assert len(got.hidden_states) == len(want.hidden_states)
    rep = conv.report()
    assert len(rep.graphs) >= len(calls) and "graphs captured" in str(rep)


def test_train_mode_labels_and_positional_call_share_parameters():
    model = hf_model("llama", layers=2)
    conv = dr.convert(model, "msar", blocks=2)
    conv.train()
    conv(IDS, labels=IDS).loss.backward()  # positional input_ids, labels by name
    grads = [p.grad for p in conv.depthrewrite.parameters()]
    assert all(g is not None for g in grads)
    conv.eval()
    conv(input_ids=IDS)
    params = {id(p) for p in conv.depthrewrite.parameters()}
    for entry in conv.__dict__["_depthrewrite"].entries():
        assert {id(p) for p in entry.module.depthrewrite.parameters()} == params


def test_another_dtype_recaptures():
    model, _ = _pair("llama", "attnres")
    conv = dr.convert(copy.deepcopy(model), "attnres").to(torch.bfloat16)
    out = conv(IDS).logits
    assert out.dtype == torch.bfloat16
    ref = model.to(torch.float32)(IDS).logits
    assert (out.float() - ref).abs().max() < 0.1


class _ToyLM(torch.nn.Module):
    """A hand-written PreNorm model whose forward depends on its call: ``depth`` runs fewer blocks (another chain),
    and more than 8 tokens take another branch (a size range the trace assumes)."""

    def __init__(self, layers: int):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, ids, depth: int | None = None):
        h = self.emb(ids)
        if ids.shape[1] > 8:
            h = h * 2
        for b in self.blocks[:depth]:
            h = h + b(h)
        return self.norm(h)


def test_a_call_with_another_chain_is_a_typed_error():
    """The new parameters are matched to sites by position in the chain: a call that runs fewer layers cannot share."""
    from depthrewrite.errors import DepthRewriteError

    ids = torch.randint(0, 50, (2, 8))
    conv = dr.convert(_ToyLM(layers=3), "attnres", example_inputs=(ids,))
    with pytest.raises(DepthRewriteError, match="matched by position in the chain"):
        conv(ids, depth=2)
    conv(ids)


def test_a_structure_never_called_eagerly_is_refused_inside_export():
    """Inside torch.export (pipelining's tracer) no graph can be captured: a call structure the model has a graph for
    is traced through it; another one is an error naming it, never the graph of another structure."""
    _, conv = _pair("llama", "attnres")
    conv(input_ids=IDS)
    ep = torch.export.export(conv, (), {"input_ids": IDS}, strict=False)
    torch.testing.assert_close(ep.module()(input_ids=IDS).logits, conv(input_ids=IDS).logits)
    with pytest.raises(Exception, match="cannot capture one while it is being traced"):
        torch.export.export(conv, (), {"input_ids": IDS, "token_type_ids": IDS}, strict=False)


def test_a_failing_shape_guard_gets_its_own_graph():
    torch.manual_seed(0)
    model = hf_model("cpmant", layers=2).eval()  # export fixes the sequence length of CPM-Ant's graph
    ids = torch.randint(0, 100, (2, 12))
    ref = model(input_ids=ids).logits
    conv = dr.convert(model, "attnres", inplace=False)
    torch.testing.assert_close(conv(input_ids=ids).logits, ref, atol=1e-4, rtol=1e-4)
    assert len(conv.report().graphs) == 2


# ---- 3. generate() with a cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_generate_greedy_equals_the_original_at_init(name, scheme):
    model, conv = _pair(name, scheme)
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(conv.generate(IDS[:, :6], **kw), model.generate(IDS[:, :6], **kw))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["block-attnres", "msar", "block-msar", "mhc", "moda"])
def test_cached_decoding_equals_recomputing(name, scheme):
    """With every new parameter randomised (MSAR's convs too), decoding with the cache gives the scores of
    recomputing the whole sequence at every step."""
    torch.manual_seed(0)
    conv = dr.convert(hf_model(name, layers=2).eval(), scheme)
    _randomise(conv)
    kw = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    a = conv.generate(IDS[:, :6], use_cache=True, **kw)
    b = conv.generate(IDS[:, :6], use_cache=False, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores)) < 1e-4
    structures = [s for s, _, _ in conv.report().graphs]
    assert any("cached)" in s and "(0 cached)" not in s for s in structures)  # a decoding graph ran


@pytest.mark.parametrize("name", HF_TYPES)
def test_generate_on_the_whole_zoo(name):
    """Every decoder of the zoo generates the original's greedy tokens at init with the cache (the scheme rotates over
    the zoo so each runs on several architectures; sliding-window caches included)."""
    scheme = SCHEMES[HF_TYPES.index(name) % len(SCHEMES)]
    torch.manual_seed(0)
    model = hf_model(name, layers=2).eval()
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    ref = model.generate(IDS[:, :6], **kw)
    conv = dr.convert(model, scheme, **_exact(scheme))
    assert torch.equal(conv.generate(IDS[:, :6], **kw), ref)


def test_a_cache_filled_by_another_model_is_refused_for_msar():
    """MSAR's conv history lives in the cache: a cache the unconverted model filled has none, so decoding with it would
    read zeros; it is a ConfigError instead."""
    from transformers import DynamicCache

    model, conv = _pair("llama", "msar")
    cache = DynamicCache(config=model.config)
    model(IDS[:, :7], cache=cache, use_cache=True)
    with pytest.raises(ConfigError, match="no decoding state"):
        conv(IDS[:, 7:8], cache=cache, use_cache=True)


def test_chunked_calls_across_a_sliding_window_edge():
    """A cache length export derives from the new tokens at the window's edge gets a graph of its own when a later
    call breaks that relation (export's own input check), not a bare RuntimeError; the decoding steps call the
    modules, so the block runner must keep that check."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = hf_model("mistral", layers=2, sliding_window=6).eval()
    conv = dr.convert(model, "attnres", inplace=False)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for a, b in ((0, 3), (3, 5)):
        torch.testing.assert_close(conv(IDS[:, a:b], cache=ours, use_cache=True).logits,
                                   model(IDS[:, a:b], cache=theirs, use_cache=True).logits, atol=1e-4, rtol=1e-4)
    try:
        got = conv(IDS[:, 5:8], cache=ours, use_cache=True).logits
    except ConfigError as e:  # the window filled up: refused, typed
        assert "sliding window" in str(e)
    else:
        torch.testing.assert_close(got, model(IDS[:, 5:8], cache=theirs, use_cache=True).logits, atol=1e-4, rtol=1e-4)
    runners = [e.runner for e in conv.__dict__["_depthrewrite"].entries() if e.runner is not None]
    assert runners
    for runner in runners:  # export's input-constraint pre-hook skips its check on a module with this attribute
        assert "_guards_fn" not in runner.__dict__ and "_guards_fn" not in runner._modules


def test_derived_cache_lengths_are_guarded_without_exports_check(monkeypatch):
    """A cache length the graph derives from the new tokens (``5 - s`` at the sliding window's edge) is one of the
    graph's own guards: a call that breaks the relation gets its own graph at selection (no failed call, no retry),
    and a call that fits runs without export's sympy input check (the same sizes, checked once)."""
    from transformers import DynamicCache
    import torch.export._unlift as unlift

    from depthrewrite.runtime.entries import Derived

    torch.manual_seed(0)
    model = hf_model("mistral", layers=2, sliding_window=6).eval()
    conv = dr.convert(model, "attnres", inplace=False)
    state = conv.__dict__["_depthrewrite"]
    retries, checks = [], []
    select, check = type(state).select, unlift._check_input_constraints_for_module

    def counted_select(self, *a, fresh=False, **k):
        retries.append(fresh)
        return select(self, *a, fresh=fresh, **k)

    monkeypatch.setattr(type(state), "select", counted_select)
    monkeypatch.setattr(unlift, "_check_input_constraints_for_module", lambda *a: checks.append(1) or check(*a))
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for a, b in ((0, 3), (3, 5), (5, 8)):  # the third call breaks the second graph's `5 - s` (a later one is refused)
        torch.testing.assert_close(conv(IDS[:, a:b], cache=ours, use_cache=True).logits,
                                   model(IDS[:, a:b], cache=theirs, use_cache=True).logits, atol=1e-4, rtol=1e-4)
    guards = [g for e in state.entries() for dims in e.guards for g in dims.values()]
    assert any(isinstance(g, Derived) for g in guards)
    assert all(e.complete for e in state.entries())
    assert len(retries) == 3 and not any(retries) and not checks


def test_a_decoding_step_does_not_copy_the_cache_onto_an_empty_constant():
    """transformers' exported DynamicCache concatenates the caller's keys and values onto an empty constant (one copy
    of the whole cache per layer per step): the converted graph reads the cache tensors themselves, and decodes as
    the original."""
    from depthrewrite.converted import _empty_constant, drop_empty_concats

    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    conv = dr.convert(model, "attnres", inplace=False)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(conv.generate(IDS[:1, :6], **kw), model.generate(IDS[:1, :6], **kw))
    steps = [e for e in conv.__dict__["_depthrewrite"].entries() if "cached" in e.structure
             and "(0 cached)" not in e.structure]
    assert steps
    for e in steps:
        assert drop_empty_concats(e.module) == 0
        cache = [n for n in e.module.graph.nodes if n.op == "placeholder" and n.name.startswith("cache_")]
        cats = [u for n in cache for u in n.users if u.target is torch.ops.aten.cat.default]
        assert len(cats) == len(cache)  # each cache tensor's one concatenation: the new token's, no constant beside it
        assert all(len(u.args[0]) == 2 and not _empty_constant(e.module, u.args[0][0]) for u in cats)


def test_a_full_sliding_window_is_a_typed_error():
    torch.manual_seed(0)
    model = hf_model("mistral", layers=2, sliding_window=4).eval()
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    ref = model.generate(IDS[:, :6], use_cache=False, **kw)
    conv = dr.convert(model, "attnres")
    with pytest.raises(ConfigError, match="sliding window of 4 tokens that is full"):
        conv.generate(IDS[:, :6], use_cache=True, **kw)
    assert torch.equal(conv.generate(IDS[:, :6], use_cache=False, **kw), ref)


def test_beam_search_reorders_the_cache():
    model, conv = _pair("llama", "attnres")
    kw = dict(max_new_tokens=4, num_beams=3, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(conv.generate(IDS[:, :6], **kw), model.generate(IDS[:, :6], **kw))


@pytest.mark.parametrize("scheme", ["msar", "block-msar"])
def test_msar_left_padded_batch_generates_as_unpadded(scheme):
    """Batched generation pads on the left: with trained (randomised) convs, the padded row's tokens equal the same
    prompt's alone, because MSAR zeroes pad positions before its convs and keeps its conv history in the cache."""
    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2).eval(), scheme)
    _randomise(conv)
    a, b = IDS[:1, :7], IDS[1:, :4]
    kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
    alone_a, alone_b = conv.generate(a, **kw), conv.generate(b, **kw)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    both = conv.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(both[0, 7:], alone_a[0, 7:]) and torch.equal(both[1, 7:], alone_b[0, 4:])
    beams = dict(kw, num_beams=3)
    assert torch.equal(conv.generate(a, **beams), conv.generate(a, **dict(beams, use_cache=False)))


# ---- 4. save and load ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_save_pretrained_from_pretrained(scheme, tmp_path):
    torch.manual_seed(0)
    conv = dr.convert(hf_model("qwen2", layers=2).eval(), scheme)
    _randomise(conv)
    ref = conv(IDS).logits
    conv.save_pretrained(tmp_path)
    assert (tmp_path / "depthrewrite.json").is_file() and (tmp_path / "config.json").is_file()
    back = dr.from_pretrained(tmp_path)
    assert dr.is_converted(back) and type(back).__name__ == "Qwen2ForCausalLM"
    assert back.report().config == conv.report().config
    torch.testing.assert_close(back(IDS).logits, ref)


def test_a_pipeline_split_is_saved_with_the_recipe(tmp_path):
    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres", blocks=2, pipeline_stages=2)
    conv.save_pretrained(tmp_path)
    back = dr.from_pretrained(tmp_path)
    assert back.pipeline_cuts == conv.pipeline_cuts and back.report().pipeline.cuts == conv.pipeline_cuts
    torch.testing.assert_close(back(IDS).logits, conv(IDS).logits)


def test_save_and_load_a_hand_written_model(tmp_path):
    conv = dr.convert(nanogpt(n_layer=2, n_embd=32), "msar", blocks=2)
    _randomise(conv)
    x = IDS % 64
    conv.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model="):
        dr.from_pretrained(tmp_path)
    back = dr.from_pretrained(tmp_path, model=nanogpt(n_layer=2, n_embd=32))
    torch.testing.assert_close(back(x), conv(x))


def test_from_pretrained_without_a_recipe_is_a_typed_error(tmp_path):
    with pytest.raises(ConfigError, match="depthrewrite.json"):
        dr.from_pretrained(tmp_path)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_recapture_and_compute_the_same(how, tmp_path):
    import io

    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2).eval(), "mhc")
    _randomise(conv)
    ref = conv(IDS).logits
    if how == "deepcopy":
        other = copy.deepcopy(conv)
    else:
        buf = io.BytesIO()
        torch.save(conv, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    assert dr.is_converted(other) and other.report().graphs == ()  # graphs are rebuilt on use, never copied
    torch.testing.assert_close(other(IDS).logits, ref)
    assert not {id(p) for p in other.parameters()} & {id(p) for p in conv.parameters()}


def test_trainer_trains_saves_and_resumes(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.randint(3, 100, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2), "attnres", blocks=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=2, use_cpu=True,
        report_to=[], logging_steps=1, learning_rate=1e-2, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=conv, args=args, train_dataset=Tokens())
    trainer.train()
    ckpt = tmp_path / "checkpoint-4"
    assert (ckpt / "depthrewrite.json").is_file()
    back = dr.from_pretrained(ckpt)
    torch.testing.assert_close(back.depthrewrite.mix_1.query, conv.depthrewrite.mix_1.query)
    # resume from step 2 in a fresh conversion: the depthrewrite parameters come back with the checkpoint
    torch.manual_seed(1)
    fresh = dr.convert(hf_model("llama", layers=2), "attnres", blocks=2)
    args.max_steps = 4
    t2 = transformers.Trainer(model=fresh, args=args, train_dataset=Tokens())
    t2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    torch.testing.assert_close(fresh.depthrewrite.mix_1.query, conv.depthrewrite.mix_1.query, atol=1e-5, rtol=1e-4)


# ---- 5. module tools are followed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, scheme", [("llama", s) for s in SCHEMES] + [("qwen2", "block-msar")])
def test_peft_lora_trains_through_the_converted_model(name, scheme):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    conv = dr.convert(hf_model(name, layers=2), scheme)
    conv.eval()
    before = conv(IDS).logits
    lora = peft.get_peft_model(conv, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for n, p in lora.named_parameters():
        if ".depthrewrite." in n:
            p.requires_grad_(True)
    lora.eval()
    torch.testing.assert_close(lora(input_ids=IDS).logits, before)  # B = 0: LoRA adds nothing yet
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    assert (lora(input_ids=IDS).logits - before).abs().max() > 1e-3  # the graph runs the LoRA layers
    lora.train()
    lora(input_ids=IDS, labels=IDS).loss.backward()
    got = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert any("lora_A" in n for n in got) and any(".depthrewrite." in n for n in got)
    assert all("lora_" in n or ".depthrewrite." in n for n in got)


def test_replaced_submodule_and_hooks_are_followed():
    """A module the graphs call live (each Linear, the MLP) is opaque to the module-tree check: replacing it or
    hooking it needs no recapture, and the new module and the hook run on every call. One the graphs depend on
    (the rotary embedding's class: its outputs are unpacked) is recaptured."""
    torch.manual_seed(0)
    orig = hf_model("llama", layers=2).eval()
    twin = copy.deepcopy(orig)
    conv = dr.convert(orig, "attnres")
    ref = conv(IDS).logits
    st = conv.__dict__["_depthrewrite"]
    old = conv.model.layers[0].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 2)
    conv.model.layers[0].mlp.down_proj = new
    twin.model.layers[0].mlp.down_proj = copy.deepcopy(new)
    doubled = conv(IDS).logits
    assert (doubled - ref).abs().max() > 1e-4  # the new module runs
    torch.testing.assert_close(doubled, twin(IDS).logits, atol=1e-5, rtol=1e-5)
    h = conv.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * 0)  # the MLP is called live: no warning
    hooked = conv(IDS).logits
    assert (hooked - doubled).abs().max() > 1e-4  # the hook's effect on the output
    h.remove()
    torch.testing.assert_close(conv(IDS).logits, doubled)
    assert st.recaptures == 0 and st.captures == 1
    rope = conv.model.rotary_emb
    conv.model.rotary_emb = type("OtherRope", (type(rope),), {})(conv.config)
    torch.testing.assert_close(conv(IDS).logits, doubled)
    assert st.recaptures == 1


def test_a_global_module_hook_fires_for_the_called_modules():
    """register_module_forward_hook runs for every module the graphs call and for the model that holds the rewritten
    chain (LlamaModel, where its glue ends), as in the original, and for nothing else (no graph module); where a
    graph inlines every module (module_calls=False) it is a typed error."""
    from depthrewrite.errors import ModuleTreeChangedError

    model, conv = _pair("llama", "attnres")
    seen: list = []
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(m))
    try:
        conv(IDS)
        called = {id(m) for m in seen}
        assert not any(isinstance(m, torch.fx.GraphModule) for m in seen)  # the graph running them is not a call
        seen.clear()
        model(IDS)
        expected = {id(m) for m in seen}
        names = {id(m): n for n, m in conv.named_modules()}
        assert {names[i] for i in called if i in names} == {n for n, m in model.named_modules() if id(m) in expected}
        off = dr.convert(copy.deepcopy(model), "attnres", module_calls=False)
        with pytest.raises(ModuleTreeChangedError, match="global module hook.*every module inlined"):
            off(IDS)
    finally:
        h.remove()


@pytest.mark.parametrize("scheme", ["attnres", "msar", "mhc", "moda"])
def test_accelerate_cpu_offload_after_conversion(scheme):
    """accelerate's cpu_offload keeps weights on the meta device and loads them in each module's own forward: a
    converted model calls those modules live, and what its graphs read directly (the depth-mixing parameters, MoDA's
    rewritten attention) is loaded by the same hooks around the call. Logits equal the model before offloading,
    with trained-looking new parameters, and the weights are offloaded again after the call."""
    accelerate = pytest.importorskip("accelerate")

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(hf_model("llama", layers=2).eval(), scheme)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    want = conv(IDS).logits
    accelerate.cpu_offload(conv, execution_device=torch.device("cpu"))
    assert {p.device.type for p in conv.parameters()} == {"meta"}
    torch.testing.assert_close(conv(IDS).logits, want, rtol=0, atol=1e-6)
    assert {p.device.type for p in conv.parameters()} == {"meta"}  # offloaded again


def test_accelerate_offload_before_conversion_disk_offload_and_generate(tmp_path):
    """Converting a model accelerate already offloads (its example inputs go to the hooks' execution device), then
    generate() and disk_offload: the original's tokens and logits, no capture per call."""
    accelerate = pytest.importorskip("accelerate")

    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    orig = copy.deepcopy(model)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    conv = dr.convert(model, "msar")
    torch.testing.assert_close(conv(IDS).logits, orig(IDS).logits, rtol=1e-5, atol=1e-5)
    st = conv.__dict__["_depthrewrite"]
    captures = st.captures
    conv(IDS)
    assert st.captures == captures and st.recaptures == 0
    prompt = IDS[:, :4]
    assert torch.equal(conv.generate(prompt, max_new_tokens=4, do_sample=False),
                       orig.generate(prompt, max_new_tokens=4, do_sample=False))

    other = dr.convert(hf_model("llama", layers=2).eval(), "attnres")
    want = other(IDS).logits
    accelerate.disk_offload(other, str(tmp_path / "disk"), execution_device=torch.device("cpu"))
    torch.testing.assert_close(other(IDS).logits, want, rtol=0, atol=1e-6)


def test_accelerate_device_map_with_offloaded_weights(tmp_path):
    """``dispatch_model`` with a device_map that offloads a block, the final norm and the new parameters to disk:
    the graphs captured before are kept (the module tree reads the same), what they read directly is loaded around
    each call; logits equal the model before dispatching (MoDA: its rewritten attention reads the block's weights)."""
    accelerate = pytest.importorskip("accelerate")

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(hf_model("llama", layers=2).eval(), "moda")
    want = conv(IDS).logits
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "disk",
                  "model.rotary_emb": "cpu", "lm_head": "cpu", "depthrewrite": "disk"}
    accelerate.dispatch_model(conv, device_map=device_map, offload_dir=str(tmp_path))
    assert conv.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    torch.testing.assert_close(conv(IDS).logits, want, rtol=0, atol=1e-6)


# ---- direct calls as HF code makes them ---------------------------------------------------------------------------


def test_direct_cached_calls_fill_the_callers_cache():
    """A DynamicCache() made without a config (it grows on update), return_dict=False, and MSAR's state beside it."""
    from transformers import DynamicCache

    _, conv = _pair("llama", "msar")
    ids = IDS[:, :7]
    full = conv(ids).logits
    for cache, flag in ((DynamicCache(), True), (DynamicCache(config=conv.config), False)):
        out = conv(ids[:, :6], cache=cache, use_cache=True, return_dict=flag)
        assert cache.get_seq_length() == 6 and (out.cache if flag else out[1]) is cache
        out = conv(ids[:, 6:], cache=cache, use_cache=True, return_dict=flag)
        logits = out.logits if flag else out[0]
        torch.testing.assert_close(logits[:, -1], full[:, 6], atol=1e-4, rtol=1e-4)
        assert cache.get_seq_length() == 7
    cache.crop(-2)  # assisted decoding rolls the cache back: MSAR's conv history cannot follow
    with pytest.raises(ConfigError, match="cropped"):
        conv(ids[:, 5:6], cache=cache, use_cache=True)


def test_fsdp_on_a_submodule_that_is_not_a_block_runs_it_as_a_module_call():
    """fully_shard on a block works (tests/test_blocks.py); on a module inside a block (the MLP) the converted model
    turns module calls on, so the MLP runs as the live module and its FSDP2 hooks gather its parameters (2-rank
    recipes: tests/frameworks/test_fsdp_recipes.py). MoDA's changed attention cannot be sharded alone: ConfigError."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = hf_model("llama", layers=2).eval()
        conv = dr.convert(model, "attnres", inplace=False)
        want = conv(IDS).logits
        fully_shard(conv.model.layers[0].mlp)
        torch.testing.assert_close(conv(IDS).logits, want)
        assert conv.__dict__["_depthrewrite"].module_calls is True
        moda = dr.convert(hf_model("llama", layers=2).eval(), "moda")
        fully_shard(moda.model.layers[1].self_attn)
        with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn is sharded with FSDP .* its call stays "
                                              r"inlined \(region changed"):
            moda(IDS)
    finally:
        dist.destroy_process_group()


def test_the_config_is_followed():
    """config.use_cache=True returns a cache as the original does; a config change (output_hidden_states) recaptures."""
    model = hf_model("llama", layers=2, use_cache=True).eval()
    conv = dr.convert(model, "attnres", inplace=False)
    assert type(conv(IDS).cache) is type(model(IDS).cache)
    conv.config.output_hidden_states = True
    assert conv(IDS).hidden_states is not None
    conv.config.output_hidden_states = False
    assert conv(IDS).hidden_states is None


def test_a_size_range_the_trace_assumed_gets_its_own_graph():
    torch.manual_seed(0)
    model = _ToyLM(layers=2).eval()  # its `if T > 8` branch: a graph captured at 4 tokens holds for 2..8 only
    ids = torch.randint(0, 50, (2, 12))
    conv = dr.convert(model, "attnres", example_inputs=(ids[:, :4],), inplace=False)
    torch.testing.assert_close(conv(ids), model(ids))
    assert len(conv.report().graphs) == 2


def test_tied_weights_load_into_a_given_model(tmp_path):
    conv = dr.convert(hf_model("llama", layers=2, tie_word_embeddings=True).eval(), "attnres")
    conv.save_pretrained(tmp_path)
    back = dr.from_pretrained(tmp_path, model=hf_model("llama", layers=2, tie_word_embeddings=True).eval())
    torch.testing.assert_close(back(IDS).logits, conv(IDS).logits)


def test_an_accelerate_hook_on_the_root_runs_the_converted_forward():
    hooks = pytest.importorskip("accelerate.hooks")
    model = hf_model("llama", layers=2).eval()
    hooks.add_hook_to_module(model, hooks.AlignDevicesHook(io_same_device=True))
    ref = model(IDS).logits
    conv = dr.convert(model, "attnres")
    _randomise(conv)
    assert (conv(IDS).logits - ref).abs().max() > 1e-4  # the converted graph ran, not the original forward
    assert sum(e.calls for e in conv.__dict__["_depthrewrite"].entries()) == 1
    plain = hf_model("llama", layers=2)
    plain.forward = lambda *a, **k: None
    with pytest.raises(ConfigError, match="del model.forward"):
        dr.convert(plain, "attnres")
