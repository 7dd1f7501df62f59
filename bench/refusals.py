"""Generate docs/errors.md: what depthrewrite says when it refuses a model, shown on real refusals.

    python -m bench.refusals [--out docs/errors.md]

Every text on that page is produced here by running ``depthrewrite.convert`` on the model named in its heading (small
configs, random weights; the hand-written models come from the tests), so the page shows the messages the code
actually raises today. A case that unexpectedly converts is reported as such, and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the tests package lives at the repository root
    sys.path.insert(0, str(ROOT))

import depthrewrite as dr  # noqa: E402
from depthrewrite.errors import DepthRewriteError  # noqa: E402
from depthrewrite.testing import PlainMLP  # noqa: E402
from depthrewrite.demo.zoo import hf_model, timm_model  # noqa: E402


def _ids(vocab: int = 32) -> tuple:
    return (torch.randint(0, vocab, (2, 6)),)


def _nanochat(**kw) -> Callable[[], None]:
    def run():
        from tests.passes.analyse.nanochat_like import NanoChatLike

        dr.convert(NanoChatLike(**kw), "attnres", example_inputs=_ids(64))

    return run


def _temperature() -> None:
    from tests.passes.rewrite.test_moda import TemperatureAttention

    dr.convert(TemperatureAttention(), "moda", example_inputs=_ids())


def _global_hook() -> None:
    conv = dr.convert(hf_model("llama", layers=2), "attnres", module_calls=False)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        conv(*_ids())
    finally:
        handle.remove()


def _litgpt_msar_continuation() -> None:
    from tests.frameworks.models import build

    model, args, _ = build("litgpt", "pythia-14m")
    conv = dr.convert(model.eval(), "msar", blocks=2, example_inputs=args)
    conv.set_kv_cache(batch_size=args[0].shape[0])
    T = args[0].shape[1]
    conv(args[0], input_pos=torch.arange(T))  # a sequence from position 0: exact
    conv(args[0][:, :1], input_pos=torch.tensor([T]))  # one more token: refused


def _torchtune_cache() -> None:
    from tests.frameworks.models import build

    model, args, _ = build("torchtune", "llama3")
    conv = dr.convert(model.eval(), "attnres", blocks=2, example_inputs=args)
    B, T = args[0].shape
    conv.setup_caches(batch_size=B, dtype=torch.float32, decoder_max_seq_len=32)
    mask = torch.tril(torch.ones(T, 32, dtype=torch.bool))[None].expand(B, -1, -1)
    conv(args[0], mask=mask, input_pos=torch.arange(T)[None].expand(B, -1))


def _olmo_core_cache() -> None:
    from tests.frameworks.flash_stand_in import build_olmo_flash, olmo_flash_on_cpu
    from tests.frameworks.models import _stubbed

    with _stubbed("olmo_core"):
        from olmo_core.generate.generation_module import GenerationConfig, TransformerGenerationModule
    with olmo_flash_on_cpu():
        model, args, _ = build_olmo_flash()
        conv = dr.convert(model, "attnres", blocks=2, example_inputs=args)
        cfg = GenerationConfig(pad_token_id=0, eos_token_id=1, max_new_tokens=2, do_sample=False, use_cache=True)
        TransformerGenerationModule(conv, cfg, device=torch.device("cpu")).generate_batch(args[0][:1, :5],
                                                                                          log_timing=False)


def _flat_checkpointing() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from depthrewrite.testing import Block
    from tests.frameworks.test_flat_graph_checkpointing import flat_model

    idx = torch.randint(0, 256, (2, 8))
    conv = dr.convert(flat_model().train(), "attnres", blocks=2, example_inputs=(idx,), module_calls=False)
    apply_activation_checkpointing(conv, check_fn=lambda m: isinstance(m, Block))
    conv(idx)


def _traced_collective() -> None:
    import tempfile

    import torch.distributed as dist

    from tests.test_converted_guards import traced_collective_model

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            conv = dr.convert(traced_collective_model(), "attnres", module_calls=False).train()
            ids = _ids()[0]
            conv(ids, labels=ids).loss.backward()
        finally:
            dist.destroy_process_group()


#: (heading, what the model does, the call that is refused)
CASES: list[tuple[str, str, Callable[[], None]]] = [
    ("BERT (`hf:bert`)", "PostNorm: each residual sum is normalised right after the add.",
     lambda: dr.convert(hf_model("bert", layers=2), "attnres")),
    ("nanochat-style backout", "A scaled earlier stream value is subtracted before the final norm.",
     _nanochat(backout=True)),
    ("nanochat-style residual scalars", "Every block starts by rescaling the stream, `x = a·x + b·x0`.",
     _nanochat(scaling="start")),
    ("timm ViT with `global_pool=\"max\"`", "The tokens are max-pooled before `fc_norm` (mean pooling converts).",
     lambda: dr.convert(timm_model("vit_tiny_patch16_224", layers=2, global_pool="max", fc_norm=True), "attnres")),
    ("Inkling2 (`hf:inkling2_text`)", "It already mixes depth: layers read attention over earlier hidden states.",
     lambda: dr.convert(hf_model("inkling2_text", layers=2), "attnres")),
    ("Dory (`hf:dory`)", "The nGPT layout: a normalised stream with interpolating steps.",
     lambda: dr.convert(hf_model("dory", layers=2), "attnres")),
    ("A plain MLP", "No skip connection anywhere.",
     lambda: dr.convert(PlainMLP(), "attnres", example_inputs=(torch.randn(2, 32),))),
    ("MoDA on attention with a learned temperature", "The scores are scaled by a parameter before the softmax.",
     _temperature),
    ("MoDA on BLOOM (`hf:bloom`)", "ALiBi written as `baddbmm(alibi, q, kᵀ)`.",
     lambda: dr.convert(hf_model("bloom", layers=2), "moda")),
    ("MoDA on MPT (`hf:mpt`)", "An ALiBi bias and a causal `masked_fill`: two masks.",
     lambda: dr.convert(hf_model("mpt", layers=2), "moda")),
    ("PaliGemma, text only (`hf:paligemma`)", "Its eager prefix attends both ways; the exported trace is causal.",
     lambda: dr.convert(hf_model("paligemma", layers=1), "attnres")),
    ("A global module hook without module calls (`hf:llama`)", "`register_module_forward_hook` (FlopCounterMode, "
     "ModuleTracker) on a model converted with `module_calls=False`: every module below the blocks is inlined, so the "
     "hook would not run for them (with the default module calls it runs for every called module).", _global_hook),
    ("Float token ids (`hf:llama`)", "A float tensor passed as `input_ids`.",
     lambda: dr.convert(hf_model("llama", layers=2), "attnres", example_kwargs={"input_ids": torch.rand(2, 6)})),
    ("MSAR continuing litgpt's own KV cache (call)", "litgpt keeps its cache in module buffers (`set_kv_cache`, calls "
     "with `input_pos`); MSAR's convs need the earlier positions, which such a call does not pass. A sequence from "
     "position 0 is exact; the next token is refused before anything is written.", _litgpt_msar_continuation),
    ("torchtune's KV cache (call)", "`setup_caches`: its `KVCache.update` asserts on a tensor's value, which export "
     "cannot trace.", _torchtune_cache),
    ("OLMo-core's KV cache (call)", "`TransformerGenerationModule` with `use_cache=True` (flash-attn's backend; here "
     "on a CPU through the tests' stand-in for its functions): the RoPE offset and write positions come from the "
     "cache module's own buffer.", _olmo_core_cache),
    ("Checkpointing a flat graph (call)", "A nanoGPT whose attention writes its mask in place and reads a view of it "
     "afterwards (converted with `module_calls=False`; with module calls the attention is one call and the blocks "
     "split): the write cannot be made out of place, the blocks stay inlined, and torch's "
     "`apply_activation_checkpointing` could recompute nothing. (litgpt's Gemma-2 used to be such a model; its "
     "`masked_fill_` on a fresh mask is now turned out of place and its blocks are modules.)", _flat_checkpointing),
    ("Tensor-parallel communication traced into a graph (backward)", "A Llama whose MLPs all-reduce their output in "
     "their own code, as a row-parallel layer does with plain local tensors (torchtitan's `spmd_types`), converted "
     "with `module_calls=False` (one rank here): the forward runs, a backward through it is refused.",
     _traced_collective),
]


def render() -> tuple[str, int]:
    out = [
        "# What depthrewrite says when it refuses",
        "",
        "Generated by `python -m bench.refusals` from the code as it is: each message below is what `convert()` (for the",
        "cases marked \"call\" and the global hook, a call of the converted model) raised on the model in the heading (small configs, random",
        "weights). Every refusal is a `DepthRewriteError` subclass, names the FX node or module that does not fit, and",
        "says what was expected and what to do. Limits are listed in",
        "[limitations.md](limitations.md); how the chain is found in [concepts.md](concepts.md).",
        "",
    ]
    unexpected = 0
    for title, what, run in CASES:
        torch.manual_seed(0)
        out += [f"## {title}", "", what, ""]
        try:
            run()
        except (ImportError, pytest.skip.Exception) as e:  # a framework that is not installed
            out += [f"(not run here: {e})", ""]
            continue
        except DepthRewriteError as e:
            body = textwrap.fill(f"{type(e).__name__}: {e}", 116, break_long_words=False, break_on_hyphens=False)
            out += ["```text", body, "```", ""]
        else:
            unexpected += 1
            out += ["(converted: this case is no longer refused)", ""]
    return "\n".join(out), unexpected


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "errors.md"))
    a = p.parse_args(argv)
    text, unexpected = render()
    Path(a.out).write_text(text)
    print(f"wrote {a.out} ({len(CASES)} cases, {unexpected} not refused)")
    return 1 if unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
