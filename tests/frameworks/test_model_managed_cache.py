"""A KV cache the model keeps in its own buffers (litgpt's ``set_kv_cache``: calls with ``input_pos``, the cache
updated in place). Schemes that mix each token's own values (AttnRes, mHC, MoDA: its depth slots are the new tokens
written by the cache's ``index_copy_``) decode exactly with it; MSAR, whose convs
read earlier positions, starts a sequence exactly and refuses to continue one (issue: never a continuation computed
as a fresh sequence). On litgpt's own GPT class, built tiny from its own config."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import depthrewrite as dr
from depthrewrite.errors import ConfigError

litgpt = pytest.importorskip("litgpt")
from litgpt.generate.base import generate as litgpt_generate  # noqa: E402

SCHEMES = {"block-attnres": ("attnres", {"blocks": 2}), "mhc": ("mhc", {}), "block-msar": ("msar", {"blocks": 2}),
           "moda": ("moda", {"preserve_init": True}), "attnres": ("attnres", {}), "msar": ("msar", {})}
PROMPT = 6


def _gpt():
    cfg = litgpt.Config.from_name("pythia-14m", n_layer=4, n_embd=64, n_head=4, block_size=32, vocab_size=128,
                                  padded_vocab_size=128)
    torch.manual_seed(0)
    return litgpt.GPT(cfg).eval()


@functools.lru_cache(maxsize=None)
def converted(key: str):
    scheme, opts = SCHEMES[key]
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(_gpt(), scheme, inplace=False, example_inputs=(ids,), **opts)
    with torch.no_grad():  # trained-looking new parameters: at init every scheme is the original function
        g = torch.Generator().manual_seed(2)
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return conv, ids


def _fresh_cache(conv):
    conv.clear_kv_cache()
    conv.set_kv_cache(batch_size=1)


@pytest.mark.parametrize("key", ["block-attnres", "attnres", "mhc", "moda"])
def test_per_token_schemes_decode_exactly_with_the_models_cache(key):
    conv, ids = converted(key)
    with torch.no_grad():
        full = conv(ids)
        _fresh_cache(conv)
        pre = conv(ids[:, :PROMPT], input_pos=torch.arange(PROMPT))
        torch.testing.assert_close(pre, full[:, :PROMPT], rtol=1e-4, atol=1e-4)
        for t in range(PROMPT, ids.shape[1]):
            step = conv(ids[:, t:t + 1], input_pos=torch.tensor([t]))
            torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-4, atol=1e-4)
        conv.clear_kv_cache()


@pytest.mark.parametrize("key", ["block-attnres", "mhc"])
def test_litgpt_generate_equals_uncached_greedy(key):
    conv, ids = converted(key)
    prompt = ids[0, :PROMPT]
    with torch.no_grad():
        want = prompt.clone()
        for _ in range(4):  # greedy without any cache: the whole sequence recomputed per token
            want = torch.cat([want, conv(want[None])[0, -1].argmax().view(1)])
        _fresh_cache(conv)
        got = litgpt_generate(conv, prompt, max_returned_tokens=PROMPT + 4, temperature=0.0, top_k=1)
        conv.clear_kv_cache()
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("key", ["block-msar", "msar"])
def test_msar_starts_a_sequence_exactly_and_refuses_to_continue_one(key):
    conv, ids = converted(key)
    with torch.no_grad():
        full = conv(ids)
        _fresh_cache(conv)
        pre = conv(ids[:, :PROMPT], input_pos=torch.arange(PROMPT))  # a sequence from position 0: exact
        torch.testing.assert_close(pre, full[:, :PROMPT], rtol=1e-4, atol=1e-4)
        before = [b.clone() for n, b in conv.named_buffers() if "kv_cache" in n]
        with pytest.raises(ConfigError, match=r"kv_cache.*input_pos = \[6\].*clear_kv_cache"):
            conv(ids[:, PROMPT:PROMPT + 1], input_pos=torch.tensor([PROMPT]))
        after = [b for n, b in conv.named_buffers() if "kv_cache" in n]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused call must not write the cache"
        # litgpt's own generate: its first one-token step is refused, never decoded as a fresh sequence
        _fresh_cache(conv)
        with pytest.raises(ConfigError, match="MSAR"):
            litgpt_generate(conv, ids[0, :PROMPT], max_returned_tokens=PROMPT + 2, temperature=0.0, top_k=1)
        conv.clear_kv_cache()
        torch.testing.assert_close(conv(ids), full)  # without the cache, the whole sequence: as before


def test_torchtune_cache_refusal_names_the_assert_and_what_to_do(capsys):
    """torchtune's KVCache.update asserts on a tensor's value: the CaptureError names that line and the way out, and
    torch.export's partial graph of the failed trace (hundreds of lines, once per attempt) is not printed."""
    from depthrewrite.errors import CaptureError
    from tests.frameworks.models import build

    model, args, kwargs = build("torchtune", "llama3")
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(model, "attnres", blocks=2, example_inputs=args, example_kwargs=kwargs)
    B, T = args[0].shape
    conv.setup_caches(batch_size=B, dtype=torch.float32, decoder_max_seq_len=32)
    mask = torch.tril(torch.ones(T, 32, dtype=torch.bool))[None].expand(B, -1, -1)
    capsys.readouterr()
    with pytest.raises(CaptureError, match=r"kv_cache\.py:\d+ in KVCache\.update.*disable_kv_cache"):
        conv(*args, mask=mask, input_pos=torch.arange(T)[None].expand(B, -1))
    assert "def forward(self" not in capsys.readouterr().err


def test_float_token_ids_name_the_dtype_first():
    from depthrewrite.demo.zoo import hf_model
    from depthrewrite.errors import CaptureError

    with pytest.raises(CaptureError, match=r"floating-point input input_ids reaches an embedding.*torch\.long"):
        dr.convert(hf_model("llama", layers=2), "attnres", example_kwargs={"input_ids": torch.rand(2, 8)})


@pytest.mark.parametrize("bad", [42, None, [1, 2]])
def test_convert_of_something_that_is_not_a_model(bad):
    with pytest.raises(ConfigError, match="takes a torch.nn.Module"):
        dr.convert(bad, "attnres")


@pytest.mark.parametrize("key", ["block-attnres", "attnres", "mhc", "moda"])
def test_litgpt_generate_at_init_gives_the_originals_tokens(key):
    """What a user converting a pretrained litgpt checkpoint sees first: at init, litgpt's own generate() with its KV
    cache returns the original model's greedy tokens (mHC with alpha_init=0, its exact option). MoDA (preserve_init)
    decodes step by step exactly (above) but generate()'s prefill reads keys and values of the whole cache length
    where its depth slots need this call's own tokens: a typed refusal, before anything is computed."""
    scheme, opts = SCHEMES[key]
    opts = {**opts, **dr.scheme(scheme).exact}
    model = _gpt()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(model, scheme, inplace=False, example_inputs=(ids,), **opts)
    prompt = ids[0, :PROMPT]
    tokens = []
    with torch.no_grad():
        for m in (model, conv):
            m.set_kv_cache(batch_size=1)
            if key == "moda" and m is conv:
                with pytest.raises(ConfigError, match=r"MoDA: the keys/values .* KV cache.*model-managed cache"):
                    litgpt_generate(m, prompt, max_returned_tokens=PROMPT + 8, temperature=0.0, top_k=1)
                return
            tokens.append(litgpt_generate(m, prompt, max_returned_tokens=PROMPT + 8, temperature=0.0, top_k=1).tolist())
            m.clear_kv_cache()
    assert tokens[1] == tokens[0]
