"""`depthrewrite demo` at tiny settings, the stdlib corpus, the training loop's variants, and rewritten-graph drawing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo import run as demo_mod
from depthrewrite.cli import main
from depthrewrite.demo.corpus import Corpus, split_of
from depthrewrite.views.draw import rewritten_networkx, rewritten_text, save_rewritten
from depthrewrite.testing import nanogpt
from depthrewrite.demo.train import VARIANTS, parse_variants


def test_demo_tiny_writes_table_and_pictures(tmp_path, capsys, monkeypatch):
    import depthrewrite.views.report as report_mod

    monkeypatch.setattr(report_mod, "graphviz_dot", lambda: None)  # a fresh machine: no Graphviz
    assert main(["demo", "--steps", "3", "--schemes", "vanilla,block-attnres", "--out", str(tmp_path),
                 "--timing", "eager"]) == 0  # compiled timing: test_demo_compiled_step_times
    out = capsys.readouterr().out
    assert "LlamaForCausalLM: 8 sublayers (4 attention, 4 mlp)" in out
    assert "standard library" in out
    table = [line for line in out.splitlines() if line.startswith(("vanilla ", "block-attnres "))]
    assert len(table) == 2 and "✓ same function" in table[1]
    md = (tmp_path / "results.md").read_text()
    assert "| block-attnres" in md and "val loss" in md
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "chain.txt").read_text().startswith("LlamaForCausalLM: 8 sublayers")
    assert "depth_attn (site output)" in (tmp_path / "rewritten_block-attnres.txt").read_text()
    # a picture with or without Graphviz (matplotlib draws it when `dot` is missing)
    assert (tmp_path / "rewritten_block-attnres.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "rewritten_block-attnres.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert (tmp_path / "chain.svg").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schemes", "vanilla,nope"], "unknown scheme(s) 'nope'"),
        (["--schemes", ","], "no schemes given"),
        (["--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_demo_bad_arguments_exit_2(argv, message, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and message in err and "Traceback" not in err


def test_parse_variants():
    assert [v.name for v in parse_variants("all")] == list(VARIANTS)
    assert [v.name for v in parse_variants(" mhc , vanilla")] == ["mhc", "vanilla"]
    with pytest.raises(dr.ConfigError, match="twice"):
        parse_variants("mhc,mhc")


def test_stdlib_corpus_split_by_file_and_batches():
    c = Corpus.stdlib(max_bytes=300_000)
    assert c.train_files > 0 and c.val_files > 0 and len(c.val) > 0
    # the split is a function of the relative path alone
    assert split_of("json/decoder.py", 0.1) == split_of("json/decoder.py", 0.1)
    g = torch.Generator().manual_seed(0)
    x, y = c.batch("train", 3, 16, g)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256
    a, b = c.eval_batches(2, 2, 8), c.eval_batches(2, 2, 8)
    assert a is b and torch.equal(a[0][0], Corpus.stdlib(max_bytes=300_000).eval_batches(2, 2, 8)[0][0])


def test_corpus_batch_samples_every_window():
    """A window is seq + 1 bytes: a split of exactly that size gives its one window, and the last window is drawn."""
    def corpus(n):
        data = torch.arange(n, dtype=torch.uint8)
        return Corpus(root=Path("."), train=data, val=data, train_files=1, val_files=1)

    x, y = corpus(5).batch("train", 4, 4, torch.Generator().manual_seed(0))
    assert x.tolist() == [[0, 1, 2, 3]] * 4 and y.tolist() == [[1, 2, 3, 4]] * 4
    x, _ = corpus(7).batch("val", 200, 4, torch.Generator().manual_seed(0))
    assert set(x[:, 0].tolist()) == {0, 1, 2}  # starts 0 .. len - (seq + 1)
    with pytest.raises(dr.ConfigError, match="fewer than a window of 5"):
        corpus(4).batch("train", 1, 4)


def _small_corpus(folder: Path) -> Path:
    folder.mkdir()
    for i in range(40):
        (folder / f"f{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    return folder


def test_demo_without_matplotlib_links_no_plot_and_keeps_one_model(tmp_path, monkeypatch):
    """results.md links only pictures that were written; only the drawn variant's model is kept, until it is drawn."""
    kept = {}
    train = demo_mod.train_variant

    def recording(build, v, *args, keep_model=False, **kwargs):
        kept[v.name] = keep_model
        return train(build, v, *args, keep_model=keep_model, **kwargs)

    def no_matplotlib(*args, **kwargs):
        raise ImportError("no matplotlib")

    monkeypatch.setattr(demo_mod, "train_variant", recording)
    monkeypatch.setattr(demo_mod, "_plot_losses", no_matplotlib)
    out = tmp_path / "out"
    out.mkdir()
    (out / "loss_curves.png").write_bytes(b"old")  # left by an earlier run: must not be linked as this run's
    lines = []
    cfg = demo_mod.DemoConfig(out=out, steps=1, schemes="vanilla,block-attnres", batch=2, seq=16, layers=2,
                              hidden=32, eval_every=0, eval_batches=1, progress=False,
                              corpus_dir=_small_corpus(tmp_path / "corpus"), timing="eager")
    results = demo_mod.run_demo(cfg, say=lines.append)
    assert kept == {"vanilla": False, "block-attnres": True}
    assert all(r.model is None for r in results)
    assert not (out / "loss_curves.png").exists() and out / "loss_curves.png" not in cfg.written
    md = (out / "results.md").read_text()
    assert "| block-attnres" in md and "loss_curves" not in md
    assert any("matplotlib is not installed" in line for line in lines)
    assert (out / "rewritten_block-attnres.txt").exists()


def test_demo_divergence_is_a_training_error(tmp_path, monkeypatch, capsys):
    """A loss that becomes NaN ends the demo with exit code 2 and a message, not a traceback."""
    import depthrewrite.demo.train as train_mod

    monkeypatch.setattr(train_mod, "_loss", lambda model, x, y: torch.tensor(float("nan"), requires_grad=True))
    corpus = _small_corpus(tmp_path / "corpus")
    assert main(["demo", "--steps", "2", "--schemes", "vanilla", "--out", str(tmp_path / "out"),
                 "--corpus", str(corpus)]) == 2
    err = capsys.readouterr().err
    assert "TrainingError" in err and "training vanilla (seed 0) diverged" in err and "at step 1 of 2" in err
    assert "lower learning rate" in err and "Traceback" not in err
    assert issubclass(dr.errors.TrainingError, FloatingPointError)


def test_corpus_from_dir_keeps_files_apart(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.py").write_text(f"x = {i}\n" * 20)
    c = Corpus.from_dir(tmp_path)
    assert c.train_files + c.val_files == 40
    val_names = {f"f{i}.py" for i in range(40) if split_of(f"f{i}.py", 0.1) == "val"}
    assert c.val_files == len(val_names) > 0
    with pytest.raises(dr.ConfigError, match="no \\*.txt files"):
        Corpus.from_dir(tmp_path, pattern="*.txt")
    with pytest.raises(dr.ConfigError, match="does not exist"):
        Corpus.from_dir(tmp_path / "missing")


@pytest.mark.parametrize(
    "scheme, options, expect",
    [
        ("attnres", {"blocks": 2}, {"depth_attn": 4, "sums": 2}),  # 2 layers = 4 sublayers: sites 1..3 + output
        ("msar", {}, {"msar_mix": 4, "sums": 0}),
        ("mhc", {}, {"mhc_pre": 4, "mhc_post": 4, "mhc_collapse": 1}),
        ("moda", {}, {"moda_attn_slots": 1}),
    ],
)
def test_rewritten_graph_is_read_from_the_converted_graph(scheme, options, expect, tmp_path):
    conv = dr.convert(nanogpt(n_layer=2, n_embd=32), scheme, **options)
    g = rewritten_networkx(conv)
    ops = [d["label"].split(" ")[0].split("\\n")[0] for _, d in g.nodes(data=True) if d["role"] == "op"]
    for op, n in expect.items():
        if op == "sums":
            assert sum(1 for n_ in g if n_.startswith("sum:")) == n
        else:
            assert ops.count(op) == n, ops
    assert {"source", "final_norm", "output"} <= set(g) and all(f"sub{i}" in g for i in range(4))
    if scheme in ("attnres", "msar"):  # every sublayer after the first reads a mix; the final norm reads the last
        assert all(any(p.startswith("op:") for p in g.predecessors(f"sub{i}")) for i in range(1, 4))
        assert [p for p in g.predecessors("final_norm")][0].startswith("op:")
        assert not any(d["role"] == "stream" and not n.startswith("sum:") for n, d in g.nodes(data=True))
    if scheme == "moda":  # the chain's residual adds stay, and the depth op sits inside the second attention
        assert "h4" in g and g.has_edge("sub2", next(n for n in g if n.startswith("op:moda_attn")))
    text = rewritten_text(conv)
    assert text.splitlines()[0].startswith("GPT -> ")
    assert save_rewritten(conv, tmp_path / "g.dot").read_text().startswith('digraph "rewritten"')
    with pytest.raises(dr.ConfigError, match="use .svg"):
        save_rewritten(conv, tmp_path / "g.jpg")


def test_drawing_needs_a_converted_model():
    with pytest.raises(dr.ConfigError, match="depthrewrite.convert"):
        rewritten_networkx(nanogpt(n_layer=1))


def test_time_steps_warms_up_before_timing():
    from depthrewrite.demo.train import time_steps

    calls = []
    times = time_steps(lambda: calls.append(1), warmup=3, timed=5)
    assert len(calls) == 8 and len(times) == 5


def test_every_variant_is_timed_warm_and_training_is_unchanged(tmp_path, monkeypatch):
    """The step time comes from warm-up + timed steps after training; they leave the trained weights as they were."""
    import depthrewrite.demo.train as train_mod
    from depthrewrite.demo.train import TrainConfig, train_variant

    corpus = Corpus.from_dir(_small_corpus(tmp_path / "corpus"))
    threads = torch.get_num_threads()
    calls = []
    real = train_mod._train_step
    monkeypatch.setattr(train_mod, "_train_step", lambda *a: calls.append(1) or real(*a))
    runs = {}
    for warm, timed in ((2, 3), (0, 1)):
        cfg = TrainConfig(steps=4, batch=2, seq=16, eval_batches=1, time_warmup=warm, timed_steps=timed)
        calls.clear()
        runs[warm] = train_variant(lambda s: nanogpt(n_layer=2, n_embd=32), VARIANTS["block-attnres"], corpus, cfg)
        assert len(calls) == 4 + warm + timed
    r = runs[2]
    assert r.timing.warmup == 2 and r.timing.timed == 3 and (r.timing.batch, r.timing.seq) == (2, 16)
    assert r.step_time > 0 and r.timing.threads == 1  # timed on one thread, the setting restored afterwards
    assert torch.get_num_threads() == threads
    assert runs[2].final_val == runs[0].final_val and runs[2].train_losses == runs[0].train_losses


def test_results_table_states_the_timing_conditions(tmp_path):
    from depthrewrite.demo.train import TrainConfig, train_variant

    corpus = Corpus.from_dir(_small_corpus(tmp_path / "corpus"))
    cfg = TrainConfig(steps=2, batch=2, seq=16, eval_batches=1, time_warmup=3, timed_steps=4)
    results = [train_variant(lambda s: nanogpt(n_layer=1, n_embd=32), VARIANTS[n], corpus, cfg) for n in ("vanilla", "attnres")]
    for fmt in ("simple", "github"):
        text = demo_mod.results_table(results, fmt=fmt)
        assert "step (ms)*" in text
        assert "median of 4 timed training steps" in text and "2 x 16" in text and "after 3 untimed warm-up steps" in text
        assert "1 torch thread," in text and "load average" in text


def test_demo_times_the_variants_in_turns(tmp_path, monkeypatch):
    """The demo times every variant after training, one step each per round, and says so under the table."""
    import depthrewrite.demo.train as train_mod

    order = []
    real = train_mod.StepTimer.step
    monkeypatch.setattr(train_mod.StepTimer, "step", lambda self: order.append(id(self)) or real(self))
    cfg = demo_mod.DemoConfig(out=tmp_path / "out", steps=1, schemes="vanilla,attnres", batch=2, seq=16, layers=2,
                              hidden=32, eval_every=0, eval_batches=1, progress=False,
                              corpus_dir=_small_corpus(tmp_path / "corpus"), timing="eager")
    results = demo_mod.run_demo(cfg, say=lambda line: None)
    a, b = order[0], order[-1]
    assert a != b and order == [a] * 3 + [b] * 3 + [a, b] * 10  # warm-up each, then turns
    assert all(r.timer is None and r.timing.interleaved and r.step_time > 0 for r in results)
    assert "timed in turns" in (tmp_path / "out" / "results.md").read_text()


def test_demo_compiled_step_times(tmp_path):
    """By default the table shows what training would run, compiled (torch.compile; the converted models with the
    depthrewrite backend), beside the eager times, in two labelled columns, and its footnote says how both were timed;
    a variant over Dynamo's recompile limit would fail, not be timed eagerly."""
    cfg = demo_mod.DemoConfig(out=tmp_path / "out", steps=1, schemes="vanilla,block-attnres", batch=2, seq=16,
                              layers=2, hidden=32, eval_every=0, eval_batches=1, progress=False,
                              corpus_dir=_small_corpus(tmp_path / "corpus"))
    assert cfg.timing == "both"
    lines = []
    results = demo_mod.run_demo(cfg, say=lines.append)
    assert all(r.step_time > 0 and r.compiled_step_time > 0 for r in results)
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| eager (ms)* " in md and "| compiled (ms)* " in md
    assert "* eager / compiled (ms): median of 10 timed training steps" in md
    assert "backend='depthrewrite'" in md
    assert any(line.startswith("== compiling 2 variants") for line in lines)
    compiled_only = demo_mod.results_table([dataclasses.replace(r, step_time=float("nan")) for r in results])
    assert "compiled (ms)*" in compiled_only and "eager (ms)" not in compiled_only
    with pytest.raises(dr.errors.ConfigError, match="timing must be one of both, compiled, eager"):
        demo_mod.run_demo(dataclasses.replace(cfg, timing="fast"))


def test_demo_keeps_its_results_when_compiling_fails(tmp_path, monkeypatch):
    """A variant torch.compile cannot compile costs the compiled column, not the trained results: the console says
    why, and the table shows the eager times."""
    import depthrewrite.demo.train as train_mod

    def fail(self, backend):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(train_mod.StepTimer, "compiled", fail)
    cfg = demo_mod.DemoConfig(out=tmp_path / "out", steps=1, schemes="vanilla", batch=2, seq=16, layers=2, hidden=32,
                              eval_every=0, eval_batches=1, progress=False, corpus_dir=_small_corpus(tmp_path / "corpus"))
    lines = []
    results = demo_mod.run_demo(cfg, say=lines.append)
    assert results[0].step_time > 0 and results[0].compiled_step_time is None
    assert "(no compiled step times: torch.compile failed: RuntimeError: no compiler here)" in lines
    md = (tmp_path / "out" / "results.md").read_text()
    assert "step (ms)*" in md and "compiled (ms)" not in md and "Eager only" in md
