"""``depthrewrite`` command line: parse arguments, call the API, print a report.

The argparse description and epilog are :data:`DESCRIPTION` and :data:`EXAMPLES` (not this docstring)::

    depthrewrite inspect hf:llama [--layers N] [--hidden D] [--graph] [--save chain.svg]
    depthrewrite inspect timm:vit_tiny_patch16_224
    depthrewrite inspect depthrewrite.testing:nanogpt
    depthrewrite convert hf:llama --scheme attnres --blocks 4
    depthrewrite convert hf:llama --scheme block-attnres
    depthrewrite convert hf:qwen2 --scheme msar [--streams 4] [-o conv_on=k] [-o 'kernel_sizes=(4,8,12)']
    depthrewrite convert hf:qwen2 --scheme mhc [--streams 4] [-o sinkhorn_iters=20]
    depthrewrite convert hf:llama --scheme moda [-o preserve_init=True]
    depthrewrite demo [--steps 120] [--schemes vanilla,attnres,mhc] [--out depthrewrite-demo] [--timing both]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from . import api
from . import zoo
from .errors import ConfigError, DepthRewriteError

__all__ = ["main"]

DESCRIPTION = (
    "Detect the PreNorm residual chain of a PyTorch transformer (captured with torch.export)\n"
    "and rewrite it into a depth-mixing scheme: AttnRes / Block AttnRes, MSAR / Block MSAR, mHC, MoDA."
)
EXAMPLES = """examples:
  depthrewrite inspect hf:llama --graph
  depthrewrite inspect timm:vit_tiny_patch16_224 --save chain.png
  depthrewrite inspect mymodels:build            (mymodels.py in the current folder)
  depthrewrite convert hf:llama --scheme block-attnres
  depthrewrite convert hf:qwen2 --scheme mhc --streams 4
  depthrewrite demo --steps 120
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="hf:<model_type> | timm:<name> | package.module:factory")
    p.add_argument("--layers", type=int, default=None, help="number of transformer blocks (default: 4 for hf:)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: 64 for hf:)")


def _check_hf_type(spec: str) -> None:
    """For ``hf:<model_type>``: :func:`depthrewrite.zoo.check_hf_type` (a short ConfigError with the closest
    known model types) before anything is built."""
    kind, _, model_type = spec.partition(":")
    if kind != "hf":
        return
    try:
        import transformers  # noqa: F401
    except ImportError:  # zoo.build says what to install
        return
    zoo.check_hf_type(model_type)


def _build(args: argparse.Namespace):
    _check_hf_type(args.spec)
    return zoo.build(args.spec, layers=args.layers, hidden=args.hidden)


def _cmd_inspect(args: argparse.Namespace) -> int:
    model = _build(args)
    report = api.inspect(model)
    print(report)
    if args.graph or args.full_graph:
        print()
        print(report.graph_text(only_chain=not args.full_graph))
    if args.save:
        path = report.save(args.save)
        print(f"\nwrote {path}")
    return 0


def _parse_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"-o expects KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.replace("-", "_"), value  # a bare string such as conv_on=k


def _cmd_convert(args: argparse.Namespace) -> int:
    model = _build(args)
    flags = (("blocks", args.blocks), ("block_size", args.block_size), ("mix_scale", args.mix_scale), ("streams", args.streams))
    options = {k: v for k, v in flags if v is not None}
    options.update(_parse_option(o) for o in args.option)
    converted = api.convert(model, args.scheme, **options)
    print(converted.report())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Inspect, convert into every scheme, check init equivalence, train on the stdlib, print and draw the results."""
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(out=Path(args.out), steps=args.steps, schemes=args.schemes, seed=args.seed,
                     corpus_dir=Path(args.corpus) if args.corpus else None, timing=args.timing)
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    results = run_demo(cfg)
    return 1 if any(r.init_ok is False for r in results) else 0


def build_parser() -> argparse.ArgumentParser:
    from .passes.rewrite.registry import SCHEME_ALIASES, scheme_names

    parser = argparse.ArgumentParser(prog="depthrewrite", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="detect and print the PreNorm residual chain of a model")
    _add_model_args(p)
    p.add_argument("--graph", action="store_true", help="also print the chain's nodes in the captured graph")
    p.add_argument("--full-graph", action="store_true", help="print every op of the captured graph, chain nodes marked "
                   "(implies --graph)")
    p.add_argument("--save", default=None, help="write the chain diagram (.png/.svg: Graphviz, else matplotlib; .dot always)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("convert", help="rewrite the chain into a depth-mixing scheme and print what changed")
    _add_model_args(p)
    aliases = "; ".join(f"{a} = {t} with " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in o.items())
                        for a, (t, o) in SCHEME_ALIASES.items())
    p.add_argument("--scheme", default="attnres", type=str.lower, choices=scheme_names(),
                   help=f"any case; {aliases} (default: attnres)")
    p.add_argument("--blocks", type=int, default=None, help="Block AttnRes / Block MSAR: number of blocks N")
    p.add_argument("--block-size", type=int, default=None, help="sublayers per block S (wins over --blocks)")
    p.add_argument("--mix-scale", choices=["count", "mean"], default=None, help="count (default, exact at init) or mean")
    p.add_argument("--streams", type=int, default=None, help="MSAR: views per source; mHC: residual streams (default 4)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other scheme option, e.g. -o 'kernel_sizes=(4,8,12)' (quoted: the shell reads "
                   "parentheses) -o conv_on=k -o sinkhorn_iters=10")
    p.set_defaults(func=_cmd_convert)

    from .demo.train import VARIANTS, default_variants

    demo_default = default_variants()  # read now, so a scheme registered after import is in the default too

    p = sub.add_parser("demo", help="convert a built-in tiny Llama into every scheme, train each on the Python stdlib, "
                       "print a table and write pictures")
    p.add_argument("--out", default="depthrewrite-demo", help="output folder (default: ./depthrewrite-demo)")
    p.add_argument("--steps", type=int, default=120, help="training steps per variant (default: 120)")
    p.add_argument("--schemes", default=demo_default,
                   help=f"comma-separated, from {', '.join(VARIANTS)}, or 'all' (default: {demo_default})")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order (default: 0)")
    p.add_argument("--corpus", default=None, help="a folder of *.py files to train on (default: the standard library)")
    p.add_argument("--timing", choices=("both", "compiled", "eager"), default="both",
                   help="step times in the table: torch.compile'd (what training would run; each variant compiles "
                   "once, tens of seconds on a CPU), eager, or both (default: both)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DepthRewriteError as e:
        print(f"depthrewrite: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
