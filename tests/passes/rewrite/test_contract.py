"""The converted-model contract, for every scheme: function-preserving at init on the whole zoo, parameters and
training, state dicts, train/eval, shapes, dtypes and devices, call signature and output type, compile, errors."""

from __future__ import annotations

import copy

import pytest
import torch

import depthrewrite as dr
from depthrewrite import ConfigError
from depthrewrite.errors import CaptureError
from depthrewrite.testing import nanogpt

from ...conftest import build_zoo_model
from ..analyse.test_chain import MORE_HF
from .helpers import INIT_RTOL, MHC_DEFAULT_RTOL, inputs_for, logits, rel_err


def _cases():
    """(scheme, options, tolerance at init) for every registered scheme (``depthrewrite.schemes()``): its exact-at-init
    options (``Scheme.exact``), a 2-block form where it has one, and its defaults where they differ from the exact
    options and a variant says they are close (``SchemeVariant.init_tol``, e.g. mHC's default init)."""
    for s in dr.schemes().values():
        yield pytest.param(s.name, s.exact, INIT_RTOL, id=s.name if not s.exact else f"{s.name}-exact")
        if s.block_form:
            yield pytest.param(s.name, {**s.exact, "blocks": 2}, INIT_RTOL, id=f"{s.name}-block2")
        close = next((v.init_tol for v in s.variants if not v.options and v.init_tol is not None), None)
        if s.exact and close is not None:
            yield pytest.param(s.name, {}, close, id=s.name)


# (scheme, options, tolerance at init)
SCHEMES = list(_cases())
ALL = list(dr.schemes())
#: options under which each scheme is function-preserving at init (used where a test compares with the original)
EXACT = {s.name: s.exact for s in dr.schemes().values()}

ZOO = [
    "hf:llama", "hf:mistral", "hf:qwen2", "hf:qwen3", "hf:gemma", "hf:gemma2", "hf:phi", "hf:gpt_neox", "hf:gpt2",
    "hf:olmo2", "hf:mixtral", "hf:cohere", "timm:vit_tiny_patch16_224", "nanogpt",
    "hf:opt",  # the stream is flattened to [B·T, D] around each MLP and viewed back
]

#: attention forms MoDA does not rewrite: BLOOM (ALiBi via baddbmm), MPT (ALiBi + masked_fill), gpt-oss (sinks)
MODA_REFUSED = {"bloom", "mpt", "gpt_oss"}
#: scheme -> the MORE_HF models it refuses (a test below asserts the refusal)
REFUSED = {"moda": MODA_REFUSED}


def _count_ops(gm, scheme):
    """Calls of the scheme's first op (``Scheme.ops[0]``: the one per mixing site), or None for a scheme without ops."""
    ops = dr.scheme(scheme).ops
    if not ops:
        return None
    op = getattr(torch.ops.depthrewrite, ops[0]).default
    return sum(1 for n in gm.graph.nodes if n.target is op)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", ZOO)
def test_function_preserving_at_init(name, scheme, options, tol):
    model = build_zoo_model(name).eval()
    conv = dr.convert(model, scheme, **options, inplace=False).eval()
    x = inputs_for(name, model)
    with torch.no_grad():
        ref, out = logits(model(*x)), logits(conv(*x))
    assert rel_err(out, ref) <= tol
    chain = conv.report().chain
    L = len(chain)
    if _count_ops(conv, scheme) is None:  # a scheme of aten ops only: nothing to count
        return
    if scheme == "moda":  # every attention after the first
        assert _count_ops(conv, scheme) == sum("attention" in s.kind for s in chain.sublayers) - 1
    else:
        assert _count_ops(conv, scheme) == L  # AttnRes/MSAR: sites 1..L-1 + output; mHC: one per sublayer
        assert len(conv.report().sites) == (L + 1 if scheme == "mhc" else L)


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("model_type", MORE_HF)
def test_function_preserving_at_init_more_hf(model_type, scheme):
    """Every other PreNorm architecture of the detection sweep converts exactly too, except the attention forms MoDA
    refuses by name (ALiBi written as baddbmm or masked_fill, attention sinks): those must fail clearly."""
    model = build_zoo_model(f"hf:{model_type}").eval()
    if model_type in REFUSED.get(scheme, ()):
        with pytest.raises(dr.AttentionPatternError, match=f"cannot be rewritten by {dr.scheme(scheme).title}") as ei:
            dr.convert(model, scheme, **EXACT[scheme], inplace=False)
        assert ei.value.node is not None and f"`{ei.value.node}`" in str(ei.value)
        return
    conv = dr.convert(model, scheme, **EXACT[scheme], inplace=False).eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert rel_err(logits(conv(ids)), logits(model(ids))) <= INIT_RTOL


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
def test_parameters_and_training_step(scheme, options, tol):
    conv = dr.convert(build_zoo_model("hf:llama"), scheme, **options)
    names = {n for n, _ in conv.named_parameters()}
    assert any(n.startswith("depthrewrite.") for n in names)
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 12))
    losses = []
    for _ in range(5):
        out = conv(ids).logits
        loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        new_grads = [p.grad for n, p in conv.named_parameters() if n.startswith("depthrewrite.")]
        assert any(g is not None and g.abs().sum() > 0 for g in new_grads)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


#: the options the contract fixtures convert with: a 2-block form where the scheme has one, else its defaults where a
#: variant says they are (close to) function-preserving, else its exact options (MoDA's preserve_init)
PAIR_OPTIONS = {
    s.name: {"blocks": 2} if s.block_form else
    {} if any(not v.options and v.init_tol is not None for v in s.variants) else dict(s.exact)
    for s in dr.schemes().values()
}


@pytest.fixture(scope="module", params=ALL)
def pair(request):
    model = build_zoo_model("hf:llama")
    return request.param, model, dr.convert(model, request.param, **PAIR_OPTIONS[request.param], inplace=False)


def test_state_dict_contract(pair):
    scheme, model, conv = pair
    orig, new = set(model.state_dict()), set(conv.state_dict())
    assert orig <= new
    added = new - orig
    assert added and all(k.startswith("depthrewrite.") for k in added)
    fresh = dr.convert(build_zoo_model("hf:llama"), scheme, **PAIR_OPTIONS[scheme])
    res = fresh.load_state_dict(model.state_dict(), strict=False)
    assert set(res.missing_keys) == added and not res.unexpected_keys
    fresh.load_state_dict(conv.state_dict())  # a saved converted state dict loads into a fresh conversion
    ids = torch.randint(0, 256, (2, 7))
    torch.testing.assert_close(fresh(ids).logits, conv(ids).logits)


@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 5), (2, 40)])
def test_any_batch_and_sequence(pair, batch, seq):
    scheme, model, conv = pair
    ids = torch.randint(0, 256, (batch, seq))
    with torch.no_grad():
        assert rel_err(conv(ids).logits, model(ids).logits) <= (MHC_DEFAULT_RTOL if scheme == "mhc" else INIT_RTOL)


def test_signature_and_output_type(pair):
    _, model, conv = pair
    ids = torch.randint(0, 256, (2, 6))
    a, b = conv(ids), conv(input_ids=ids)
    assert type(a) is type(model(ids)) and torch.equal(a.logits, b.logits)
    c = conv(ids, labels=ids)  # another call structure: a graph of its own, the same parameters
    torch.testing.assert_close(c.loss, model(ids, labels=ids).loss, atol=2e-3, rtol=1e-3)


def test_inspect_of_converted_model_is_its_report(pair):
    scheme, _, conv = pair
    assert dr.inspect(conv) == conv.report()
    assert repr(conv).startswith("LlamaForCausalLM(") and "converted by depthrewrite" in repr(conv)
    assert str(conv.report()).startswith("LlamaForCausalLM -> ")


def test_deepcopy_gives_an_independent_model(pair):
    scheme, _, conv = pair
    dup = copy.deepcopy(conv)
    assert type(dup) is type(conv) and dr.is_converted(dup) and dup is not conv
    assert dup.report().config == conv.report().config and list(dup.state_dict()) == list(conv.state_dict())
    ours, theirs = dict(dup.named_parameters()), dict(conv.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(ours[k] is not theirs[k] and torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        assert torch.equal(dup(ids).logits, conv(ids).logits)


@pytest.mark.parametrize("scheme", ALL)
def test_train_eval_switches_dropout(scheme):
    model = build_zoo_model("hf:gpt2")
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.5
    model = type(model)(model.config)  # rebuild with dropout > 0
    conv = dr.convert(model, scheme, **EXACT[scheme], inplace=False)
    ids = torch.randint(0, 256, (2, 8))
    conv.eval()
    model.eval()
    with torch.no_grad():
        e1, e2 = conv(ids).logits, conv(ids).logits
        assert torch.equal(e1, e2) and rel_err(e1, model(ids).logits) <= INIT_RTOL
        conv.train()
        t1, t2 = conv(ids).logits, conv(ids).logits
        assert not torch.equal(t1, t2)
        conv.eval()
        assert torch.equal(conv(ids).logits, e1)  # back to the eval graph


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_to_half_dtypes_runs(scheme, dtype):
    model = build_zoo_model("hf:llama")
    conv = dr.convert(model, scheme, **EXACT[scheme], inplace=False).to(dtype)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        out = conv(ids).logits
        ref = model.to(dtype)(ids).logits
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out.float(), ref.float()) < 0.1  # half-precision-level differences only


@pytest.mark.parametrize("scheme", ALL)
def test_another_dtype_gets_its_own_graph(scheme):
    """.to(dtype) (or device) makes the next call capture in that dtype: baked dtypes and devices follow, and the
    model's own fp32 upcasts are kept (no retargeting of a graph captured in another dtype)."""
    model = build_zoo_model("hf:llama").eval()
    conv = dr.convert(model, scheme, **EXACT[scheme], inplace=False).to(torch.float64)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        out = conv(ids).logits
        ref = model.to(torch.float64)(ids).logits
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert any("train" not in s for s, _, _ in conv.report().graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ALL)
def test_to_cuda_matches_cpu(scheme):
    conv = dr.convert(build_zoo_model("hf:llama"), scheme)
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        ref = conv(ids).logits
        out = conv.to("cuda")(ids.cuda()).logits.cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_torch_compile_runs_and_matches():
    """One inductor compile per scheme on a tiny model: forward and backward through the registered ops."""
    idx = torch.randint(0, 256, (2, 9))
    for scheme in ALL:
        conv = dr.convert(nanogpt(n_layer=2, n_embd=32), scheme)
        for n, p in conv.named_parameters():
            if n.startswith("depthrewrite.") and "phi" not in n:
                p.data.add_(torch.randn_like(p) * 0.1)
        torch._dynamo.reset()
        out = torch.compile(conv)(idx)
        torch.testing.assert_close(out, conv(idx), rtol=1e-4, atol=1e-4)
        out.sum().backward()
        assert any(p.grad is not None for n, p in conv.named_parameters() if n.startswith("depthrewrite."))


@pytest.mark.parametrize("scheme", ALL)
def test_unknown_options_and_bad_values(scheme):
    with pytest.raises(ConfigError, match="no option"):
        dr.convert(nanogpt(n_layer=1), scheme, bogus=1)


def test_convert_refuses_a_captured_graph():
    gm = dr.capture(nanogpt(n_layer=1))
    with pytest.raises(ConfigError, match="original nn.Module"):
        dr.convert(gm, "attnres", inplace=False)


def test_a_call_the_model_refuses_is_a_capture_error(pair):
    _, _, conv = pair
    with pytest.raises(CaptureError, match="input_ids or inputs_embeds"):
        conv()


@pytest.mark.parametrize(
    "scheme, options",
    [("attnres", {"eps": "x"}), ("msar", {"kernel_sizes": 4}), ("mhc", {"alpha_init": "x"}), ("moda", {"ffn_kv": 1})],
)
def test_option_types_are_checked_before_capture(scheme, options):
    with pytest.raises(ConfigError, match="must be"):
        dr.convert(nanogpt(n_layer=1), scheme, **options)
