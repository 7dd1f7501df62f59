"""MSAR specifics: the independent reference, equality with AttnRes at init, single-stream block state, causality,
and chunked decoding with the conv state."""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
from depthrewrite import ConfigError
from depthrewrite.kernels.msar import causal_depthwise_conv, msar_mix_ref
from depthrewrite.testing import nanogpt

from ...conftest import build_zoo_model
from .helpers import (INIT_RTOL, assert_matches_reference, inputs_for, logits, mix_name, msar_reference_pair,
                      randomise_like_reference, rel_err)
from .reference_models import Decoder, MSARDecoder, causal_conv_taps


def test_conv_identity_init_in_the_tap_layout():
    """msar.md §4.1: the current token is the last tap; identity init is w[:, k-1] = 1."""
    conv = dr.convert(nanogpt(n_layer=1), "msar")
    site = conv.depthrewrite.mix_1
    for w, k in zip(site.conv, (4, 8, 12)):
        assert w.shape[1] == k and torch.equal(w[:, k - 1], torch.ones(w.shape[0])) and w[:, : k - 1].abs().sum() == 0
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(causal_depthwise_conv(x, site.conv[2].detach()), x)
    w = torch.randn(64, 5)
    torch.testing.assert_close(causal_depthwise_conv(x, w), causal_conv_taps(x, w))


@pytest.mark.parametrize("mix_scale", ["count", "mean"])
@pytest.mark.parametrize("blocks", [None, 2], ids=["full", "block2"])
def test_equals_attnres_at_init(blocks, mix_scale):
    model = build_zoo_model("hf:qwen2").eval()
    x = inputs_for("hf:qwen2", model)
    a = dr.convert(model, "attnres", blocks=blocks, mix_scale=mix_scale, inplace=False).eval()
    m = dr.convert(model, "msar", blocks=blocks, mix_scale=mix_scale, inplace=False).eval()
    with torch.no_grad():
        assert rel_err(logits(m(*x)), logits(a(*x))) <= INIT_RTOL


@pytest.mark.parametrize("S", [1, 2, 4], ids=lambda s: f"S{s}")
def test_independent_reference(S):
    kernels = (2, 3, 5)
    vanilla, ref = msar_reference_pair(S, kernels)
    idx = torch.randint(0, 64, (2, 7))
    conv = dr.convert(vanilla, "msar", block_size=S, kernel_sizes=kernels, example_inputs=(idx,), inplace=False)
    randomise_like_reference(ref, conv)
    assert_matches_reference(ref, conv, idx, mix_name)


def test_mixer_eps_is_fixed_not_the_models():
    """msar.md §5: the mixer's RMS uses eps_mix = 1e-6 whatever the model's norm ε (here 1e-5, which the key norms
    keep). Activations are scaled down so that |Z|²/(mD) is comparable to ε and the two readings differ clearly."""
    torch.manual_seed(0)
    kernels = (2, 3, 5)
    vanilla = Decoder(layers=2, norm_eps=1e-5)
    with torch.no_grad():
        for name, p in vanilla.named_parameters():
            if name.startswith("emb") or name.endswith(("proj.weight", "down.weight")):
                p.mul_(2e-3)
    ref = MSARDecoder(layers=2, kernels=kernels, norm_eps=1e-5)
    ref.load_state_dict(vanilla.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 7))
    conv = dr.convert(vanilla, "msar", kernel_sizes=kernels, example_inputs=(idx,), inplace=False)
    mixes = [n for n in conv.graph.nodes if n.target is torch.ops.depthrewrite.msar_mix.default]
    assert mixes and all(n.args[7] == 1e-5 and n.args[11] == 1e-6 for n in mixes)  # key ε = model's, mixer ε fixed
    randomise_like_reference(ref, conv)
    assert_matches_reference(ref, conv, idx, mix_name)
    # the option is honoured, and the reference then no longer matches
    other = dr.convert(vanilla, "msar", kernel_sizes=kernels, eps_mix=1e-5, example_inputs=(idx,), inplace=False)
    randomise_like_reference(ref, other)
    assert all(n.args[11] == 1e-5 for n in other.graph.nodes if n.target is torch.ops.depthrewrite.msar_mix.default)
    with torch.no_grad():
        assert rel_err(other(idx), ref(idx)) > 1e-4


@pytest.mark.parametrize("bad", [0.0, -1e-6, float("inf"), float("nan"), True, "1e-6"])
def test_eps_mix_is_validated(bad):
    with pytest.raises(ConfigError, match="eps_mix"):
        dr.MSARConfig(eps_mix=bad)


def test_block_msar_stores_single_stream_summaries():
    model = nanogpt(n_layer=4)  # L = 8
    rep = dr.convert(model, "msar", blocks=2, inplace=False).report()  # S = 4, N_eff = 2
    assert rep.stored_sources == 2 + 1  # (N_eff + 1)·d, like Block AttnRes; not m·(N_eff + 1)·d
    assert rep.memory_per_token == 3 * 64 * 4
    assert rep.stored_sources == dr.convert(model, "attnres", blocks=2, inplace=False).report().stored_sources
    assert "Block MSAR (S=4" in str(rep) and "m=4 streams" in str(rep)


CAUSAL = ["hf:llama", "hf:mistral", "hf:qwen2", "hf:qwen3", "hf:gemma", "hf:gemma2", "hf:phi", "hf:gpt_neox", "hf:gpt2", "hf:olmo2", "hf:mixtral", "hf:cohere", "nanogpt"]


@pytest.mark.parametrize("name", CAUSAL)
def test_causality(name):
    """Perturbing position t changes no output before t, with random convs, queries and mixer."""
    model = build_zoo_model(name).eval()
    conv = dr.convert(model, "msar", inplace=False).eval()
    g = torch.Generator().manual_seed(0)
    for n, p in conv.named_parameters():
        if n.startswith("depthrewrite."):
            p.data.add_(torch.randn(p.shape, generator=g) * 0.3)
    (ids,) = inputs_for(name, model, seq=10)
    t = 6
    ids2 = ids.clone()
    ids2[:, t] = (ids2[:, t] + 1) % 64
    with torch.no_grad():
        a, b = logits(conv(ids)), logits(conv(ids2))
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_two_chunk_decoding_with_conv_state():
    """docs/msar.md: a decoder keeps the last k_max-1 positions of every source; with that state two chunks give
    exactly the whole-sequence result."""
    torch.manual_seed(0)
    K, T, d, kernels = 3, 20, 16, (4, 8, 12)
    m = len(kernels) + 1
    src = [torch.randn(2, T, d) for _ in range(K)]
    params = dict(
        query=torch.randn(m, d), gain=torch.rand(m, d) + 0.5, conv=[torch.randn(d, k) for k in kernels],
        phi=torch.randn(m * d, m) * 0.1, bias=torch.randn(m), alpha=torch.tensor([0.5]),
    )
    whole = msar_mix_ref(src, **params, eps=1e-6, scale=3.0)
    cut = 13
    first = msar_mix_ref([s[:, :cut] for s in src], **params, eps=1e-6, scale=3.0)
    # the state: the last k_max-1 positions of each source (zeros before the sequence starts)
    state = [torch.cat([torch.zeros(2, max(kernels) - 1, d), s[:, :cut]], 1)[:, -(max(kernels) - 1) :] for s in src]
    second = msar_mix_ref([s[:, cut:] for s in src], **params, eps=1e-6, scale=3.0, left=state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(streams=1), "streams must be an integer >= 2"),
        (dict(streams=3, kernel_sizes=(4, 8, 12)), "kernel_sizes must be 2"),
        (dict(conv_on="v"), "conv_on"),
        (dict(mixer="max"), "mixer"),
        (dict(blocks=0), "blocks must be"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        dr.convert(nanogpt(n_layer=1), "msar", **kwargs)


def test_options_keys_only_and_mean_mixer_still_exact_at_init():
    model = build_zoo_model("hf:llama").eval()
    x = inputs_for("hf:llama", model)
    conv = dr.convert(model, "msar", conv_on="k", mixer="mean", streams=3, inplace=False).eval()
    assert len(conv.depthrewrite.mix_1.conv) == 2 and conv.depthrewrite.mix_1.conv[1].shape[1] == 8  # k_r = 4r
    with torch.no_grad():
        assert rel_err(logits(conv(*x)), logits(model(*x))) <= INIT_RTOL


def test_mean_mixer_has_no_unused_parameters():
    """An unused parameter would make DDP require find_unused_parameters=True."""
    conv = dr.convert(nanogpt(n_layer=1), "msar", mixer="mean")
    site = conv.depthrewrite.mix_1
    assert not hasattr(site, "phi") and not hasattr(site, "bias")
    conv(torch.randint(0, 256, (2, 6))).sum().backward()
    assert all(p.grad is not None for n, p in conv.named_parameters() if n.startswith("depthrewrite."))


def test_full_is_reported_as_full_when_blocks_equal_sublayers():
    rep = dr.convert(nanogpt(n_layer=2), "msar", blocks=4).report()  # L = 4, S = 1
    assert "Full MSAR" in str(rep) and rep.sites[-1].sources == ("emb", "out0", "out1", "out2", "out3")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_op_uses_eps_mix_for_the_mixer_only(backend, monkeypatch):
    """msar_mix(..., eps_mix): the mixer RMS reads eps_mix, the key norms eps; forward and every gradient equal the
    reference with the two ε apart, on the reference path and in the fused kernels (Triton's interpreter on CPU)."""
    from depthrewrite.kernels.dispatch import kernel_backend
    from depthrewrite.kernels.msar import msar_mix

    g = torch.Generator().manual_seed(0)
    K, T, D, ks = 3, 5, 6, (2, 3)
    m = len(ks) + 1
    src = [torch.randn(2, T, D, generator=g) * 3e-3 for _ in range(K)]  # |Z|²/(mD) ~ 1e-5: ε matters
    params = [torch.randn(m, D, generator=g), torch.rand(m, D, generator=g) + 0.5]
    conv = [torch.randn(D, k, generator=g) * 0.5 for k in ks]
    mix = [torch.randn(m * D, m, generator=g) * 0.3, torch.randn(m, generator=g), torch.tensor(0.7)]

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_(True) for t in [*src, *params, *conv, *mix]]
        s, (q, gn), cv, mx = leaves[:K], leaves[K : K + 2], leaves[K + 2 : K + 2 + len(ks)], leaves[K + 2 + len(ks) :]
        out = fn(s, q, gn, cv, *mx, 1e-4, float(K), True, True, **kw)
        return out, torch.autograd.grad(out.square().sum(), leaves)

    want, gwant = run(msar_mix_ref, eps_mix=1e-6)
    same, _ = run(msar_mix_ref, eps_mix=1e-4)  # eps_mix = eps
    assert rel_err(same, want) > 1e-3
    from depthrewrite.kernels.msar import fused

    calls = []
    for fn in ("msar_fwd", "msar_bwd"):
        orig = getattr(fused, fn)
        monkeypatch.setattr(fused, fn, lambda *a, _o=orig, _n=fn, **kw: (calls.append(_n), _o(*a, **kw))[1])
    with kernel_backend(backend):
        got, ggot = run(msar_mix, eps_mix=1e-6)
    assert calls == ([] if backend == "reference" else ["msar_fwd", "msar_bwd"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for a, b in zip(ggot, gwant):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_op_default_eps_mix_is_the_spec_value():
    """msar.md §5: the mixer's RMS ε defaults to 1e-6 in the op and the reference too (it used to fall back to the key
    norm's ε), matching MSARConfig.eps_mix."""
    import inspect

    from depthrewrite.kernels.msar import msar_mix, msar_mix_ref

    g = torch.Generator().manual_seed(0)
    K, T, D, ks = 3, 5, 6, (2, 3)
    m = len(ks) + 1
    src = [torch.randn(2, T, D, generator=g) * 3e-3 for _ in range(K)]
    args = (torch.randn(m, D, generator=g), torch.rand(m, D, generator=g) + 0.5,
            [torch.randn(D, k, generator=g) * 0.5 for k in ks], torch.randn(m * D, m, generator=g) * 0.3,
            torch.randn(m, generator=g), torch.tensor(0.7), 1e-4, float(K), True, True)
    want = msar_mix_ref(src, *args, eps_mix=1e-6)
    torch.testing.assert_close(msar_mix_ref(src, *args), want, rtol=0, atol=0)
    torch.testing.assert_close(msar_mix(src, *args), want, rtol=1e-6, atol=1e-9)
    assert inspect.signature(msar_mix_ref).parameters["eps_mix"].default == dr.MSARConfig().eps_mix == 1e-6


@pytest.mark.parametrize("T", [1, 3], ids=lambda t: f"T{t}")
def test_op_with_left_context_is_the_op_on_the_longer_sequence(T):
    """A decoding step's mix (``left``: each source's last k_max−1 positions) equals the mix of ``[left, source]``
    with only the new positions kept, forward and backward (sources, left context, every parameter): the decode graph
    computes T positions instead of k_max−1 + T."""
    from depthrewrite.kernels.msar import msar_mix

    g = torch.Generator().manual_seed(0)
    K, D, ks = 3, 6, (2, 4)
    m, k1 = len(ks) + 1, max(ks) - 1
    src = [torch.randn(2, T, D, generator=g, requires_grad=True) for _ in range(K)]
    left = [torch.randn(2, k1, D, generator=g, requires_grad=True) for _ in range(K)]
    params = [torch.randn(m, D, generator=g), torch.rand(m, D, generator=g) + 0.5,
              [torch.randn(D, k, generator=g) * 0.5 for k in ks], torch.randn(m * D, m, generator=g) * 0.3,
              torch.randn(m, generator=g), torch.tensor(0.7)]
    leaves = [params[0], params[1], *params[2], *params[3:]]
    for p in leaves:
        p.requires_grad_(True)
    rest = (1e-4, float(K), True, True, 1e-6)
    got = msar_mix(src, *params, *rest, left)
    want = msar_mix([torch.cat([a, b], -2) for a, b in zip(left, src)], *params, *rest)[..., k1:, :]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, msar_mix_ref(src, *params, *rest[:4], left=left), rtol=0, atol=0)
    w = torch.randn(got.shape, generator=g)
    ours = torch.autograd.grad((got * w).sum(), [*src, *left, *leaves])
    theirs = torch.autograd.grad((want * w).sum(), [*src, *left, *leaves])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
