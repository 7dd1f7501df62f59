"""convert(model, "attnres"): init equivalence on the zoo, an independent reference, and the converted-model contract.

Tolerance for init equivalence: max|Δ| / max|ref| ≤ 1e-5 in fp32 with mix_scale="count". At init every mix is
K·(1/K)·Σ sources = the standard stream exactly up to fp32 summation order, so the error is a few ulps of the
logits (measured ~4e-7), and 1e-5 leaves headroom for deeper models while still catching an ε- or scale-bug
(the "mean" mix shifts every norm's ε by K² and gives 1e-3..1e-1, spec §5).
"""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
from depthrewrite import AttnResConfig, ConfigError, DepthRewriteError, NotPreNormError
from depthrewrite.passes.rewrite.attnres import sources_at
from depthrewrite.testing import NoNormResidual, nanogpt

from ...conftest import build_zoo_model
from .attnres_reference import Decoder

INIT_RTOL = 1e-5

ZOO = [
    "hf:llama", "hf:mistral", "hf:qwen2", "hf:qwen3", "hf:gemma", "hf:gemma2", "hf:phi", "hf:gpt_neox", "hf:gpt2",
    "hf:olmo2", "hf:mixtral", "hf:cohere", "timm:vit_tiny_patch16_224", "nanogpt",
]


def _inputs(name, model, batch=2, seq=9):
    if name.startswith("timm:"):
        return (torch.randn(batch, 3, 224, 224),)
    vocab = model.config.vocab_size if hasattr(model, "config") and hasattr(model.config, "vocab_size") else 256
    return (torch.randint(0, vocab, (batch, seq)),)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("blocks", [None, 2], ids=["full", "block2"])
@pytest.mark.parametrize("name", ZOO)
def test_function_preserving_at_init(name, blocks):
    model = build_zoo_model(name).eval()
    conv = dr.convert(model, "attnres", blocks=blocks).eval()
    x = _inputs(name, model)
    with torch.no_grad():
        ref, out = _logits(model(*x)), _logits(conv(*x))
    assert _rel(out, ref) <= INIT_RTOL
    n_mix = sum(1 for n in conv.graph.nodes if n.target is torch.ops.depthrewrite.depth_attn.default)
    L = len(conv.report().chain)
    assert n_mix == L  # sites 1..L-1 and the output site; sublayer 0 has one source
    assert len(conv.report().sites) == n_mix


@pytest.mark.parametrize("model_type", __import__("tests.passes.analyse.test_chain", fromlist=["MORE_HF"]).MORE_HF)
def test_function_preserving_at_init_more_hf(model_type):
    """Every other PreNorm architecture of the detection sweep converts exactly too (Full AttnRes)."""
    model = build_zoo_model(f"hf:{model_type}").eval()
    conv = dr.convert(model, "attnres").eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert _rel(_logits(conv(ids)), _logits(model(ids))) <= INIT_RTOL


def test_mean_scale_is_paper_literal_and_close_only_up_to_eps():
    model = build_zoo_model("hf:llama").eval()
    conv = dr.convert(model, "attnres", mix_scale="mean").eval()
    x = _inputs("hf:llama", model)
    with torch.no_grad():
        err = _rel(_logits(conv(*x)), _logits(model(*x)))
    assert 0 < err < 0.2  # the ε shift of spec §5: visible, bounded


def _randomise(conv, ref, seed=1):
    g = torch.Generator().manual_seed(seed)
    box = conv.depthrewrite
    for j, mix in ref.mixes.items():
        site = getattr(box, f"mix_{j}")
        for name in ("query", "gain"):
            v = torch.randn(getattr(mix, name).shape, generator=g) * (1.0 if name == "query" else 0.3) + (0 if name == "query" else 1)
            getattr(mix, name).data.copy_(v)
            getattr(site, name).data.copy_(v)


@pytest.mark.parametrize("S", [1, 2, 4, 6], ids=lambda s: f"S{s}")  # S=1 Full, S=4 last block shorter, S=L one block
@pytest.mark.parametrize("count", [True, False], ids=["count", "mean"])
def test_independent_reference(S, count):
    torch.manual_seed(0)
    vanilla = Decoder(layers=3)
    ref = Decoder(layers=3, use_attnres=True, block_size=S, count=count)
    ref.load_state_dict(vanilla.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 7))
    conv = dr.convert(vanilla, "attnres", block_size=S, mix_scale="count" if count else "mean", example_inputs=(idx,))
    _randomise(conv, ref)
    out_ref, out = ref(idx), conv(idx)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    conv_params = dict(conv.named_parameters())
    for name, p in ref.named_parameters():
        cname = f"depthrewrite.mix_{name.split('.')[1]}.{name.split('.')[2]}" if name.startswith("mixes.") else name
        assert p.grad is not None, name
        torch.testing.assert_close(conv_params[cname].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_block_size_one_equals_full():
    model = build_zoo_model("hf:qwen2")
    full = dr.convert(model, "attnres")
    s1 = dr.convert(model, AttnResConfig(block_size=1))
    s1.load_state_dict(full.state_dict())
    for p in full.depthrewrite.parameters():
        p.data.normal_()
    s1.load_state_dict(full.state_dict())
    x = _inputs("hf:qwen2", model)
    torch.testing.assert_close(_logits(s1(*x)), _logits(full(*x)))


@pytest.mark.parametrize("S", [1, 2, 3])
def test_source_counts_follow_the_spec_and_never_repeat(S):
    model = nanogpt(n_layer=3)  # L = 6
    rep = dr.convert(model, "attnres", block_size=S).report()
    L = len(rep.chain)
    for site in rep.sites:
        j = L if site.site == "output" else site.site
        assert len(site.sources) == sources_at(j, S)
        assert len(set(site.sources)) == len(site.sources)
    assert rep.stored_sources == (L + 1 if S == 1 else -(-L // S) + 1)


def test_blocks_vs_block_size_precedence_and_report():
    model = nanogpt(n_layer=3)
    rep = dr.convert(model, "attnres", blocks=4, block_size=3).report()  # block_size wins
    assert rep.block_size == 3
    rep4 = dr.convert(model, "attnres", blocks=4).report()  # L=6, N=4 -> S=2, N_eff=3
    assert rep4.block_size == 2 and rep4.stored_sources == 4
    text = str(rep4)
    assert "Block AttnRes (S=2" in text and "new parameters:" in text and "bytes" in text
    assert rep4.memory_per_token == 4 * 64 * 4
    assert rep4.new_params == sum(s.params for s in rep4.sites) == 2 * 64 * len(rep4.sites)


# ---------------------------------------------------------------------------------------------------- the contract


@pytest.fixture(scope="module")
def llama_pair():
    model = build_zoo_model("hf:llama")
    return model, dr.convert(model, "attnres", blocks=2)


def test_parameters_and_training_step():
    conv = dr.convert(build_zoo_model("hf:llama"), "attnres", blocks=2)
    names = {n for n, _ in conv.named_parameters()}
    assert any(n.startswith("depthrewrite.mix_") for n in names)
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 12))
    losses = []
    for _ in range(5):
        logits = conv(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert conv.depthrewrite.mix_1.query.grad.abs().sum() > 0  # w gets a gradient at init (spec §2)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_state_dict_contract(llama_pair):
    model, conv = llama_pair
    orig, new = set(model.state_dict()), set(conv.state_dict())
    assert orig <= new
    added = new - orig
    assert added and all(k.startswith("depthrewrite.") for k in added)
    fresh = dr.convert(build_zoo_model("hf:llama"), "attnres", blocks=2)
    res = fresh.load_state_dict(model.state_dict(), strict=False)
    assert set(res.missing_keys) == added and not res.unexpected_keys
    fresh.load_state_dict(conv.state_dict())  # a saved converted state dict loads into a fresh conversion


@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 5), (2, 40)])
def test_any_batch_and_sequence(llama_pair, batch, seq):
    model, conv = llama_pair
    ids = torch.randint(0, 256, (batch, seq))
    with torch.no_grad():
        assert _rel(conv(ids).logits, model(ids).logits) <= INIT_RTOL


def test_signature_and_output_type(llama_pair):
    model, conv = llama_pair
    ids = torch.randint(0, 256, (2, 6))
    a, b = conv(ids), conv(input_ids=ids)
    assert type(a) is type(model(ids)) and torch.equal(a.logits, b.logits)
    with pytest.raises(ConfigError, match="labels"):
        conv(ids, labels=ids)


def test_train_eval_switches_dropout():
    model = build_zoo_model("hf:gpt2")
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.5
    model = type(model)(model.config)  # rebuild with dropout > 0
    conv = dr.convert(model, "attnres")
    ids = torch.randint(0, 256, (2, 8))
    conv.eval()
    model.eval()
    with torch.no_grad():
        e1, e2 = conv(ids).logits, conv(ids).logits
        assert torch.equal(e1, e2) and _rel(e1, model(ids).logits) <= INIT_RTOL
        conv.train()
        t1, t2 = conv(ids).logits, conv(ids).logits
    assert not torch.equal(t1, t2)
    conv.eval()
    with torch.no_grad():
        assert torch.equal(conv(ids).logits, e1)  # back to the eval graph


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_to_half_dtypes_runs(dtype):
    model = build_zoo_model("hf:llama")
    conv = dr.convert(model, "attnres").to(dtype)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        out = conv(ids).logits
        ref = model.to(dtype)(ids).logits
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out.float(), ref.float()) < 0.1  # half-precision-level differences only
    assert conv.depthrewrite.mix_1.query.dtype == dtype


def test_to_device_retargets_the_graph():
    """Baked device arguments (arange(..., device=cpu)) follow .to(device); 'meta' stands in for a GPU on CPU CI."""
    conv = dr.convert(build_zoo_model("hf:llama"), "attnres").to("meta")
    out = conv(torch.randint(0, 256, (2, 8), device="meta"))
    assert out.logits.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_cuda_matches_cpu():
    model = build_zoo_model("hf:llama")
    conv = dr.convert(model, "attnres")
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        ref = conv(ids).logits
        out = conv.to("cuda")(ids.cuda()).logits.cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_inspect_of_converted_model_is_its_report(llama_pair):
    _, conv = llama_pair
    assert dr.inspect(conv) is conv.report()
    assert repr(conv).startswith("ConvertedLlamaForCausalLM(scheme='attnres'")


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scheme="nope"), "unknown scheme"),
        (dict(blocks=0), "blocks must be an integer >= 1"),
        (dict(blocks=99), "larger than the model's 4 sublayers"),
        (dict(block_size=-1), "block_size must be"),
        (dict(mix_scale="max"), "mix_scale"),
        (dict(bogus=1), "no option"),
    ],
)
def test_config_errors(kwargs, match):
    model = nanogpt(n_layer=2)
    with pytest.raises(ConfigError, match=match):
        dr.convert(model, **kwargs)


def test_model_that_fails_detection():
    with pytest.raises(NotPreNormError) as ei:
        dr.convert(NoNormResidual(), "attnres")
    assert isinstance(ei.value, DepthRewriteError) and ei.value.node


def test_deepcopy_gives_a_clear_error(llama_pair):
    import copy

    with pytest.raises(DepthRewriteError, match="state_dict"):
        copy.deepcopy(llama_pair[1])


def test_torch_compile_runs_and_matches():
    """One inductor compile for the module (~40 s on 2 cores): forward and backward through the registered op."""
    model = nanogpt(n_layer=1, n_embd=32)
    conv = dr.convert(model, "attnres")
    for p in conv.depthrewrite.parameters():
        p.data.normal_(0, 0.5)
    idx = torch.randint(0, 256, (2, 9))
    torch._dynamo.reset()
    compiled = torch.compile(conv)
    out = compiled(idx)
    torch.testing.assert_close(out, conv(idx), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert conv.depthrewrite.mix_1.query.grad is not None
