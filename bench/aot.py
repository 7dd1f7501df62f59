"""Ahead-of-time compile check of every fused kernel for sm_80 and sm_90, without a GPU.

``python -m bench.aot [--arch 80,90] [--op depth_attn,mhc,msar,moda] [--dtype fp32,fp16,bf16] [--json PATH]``

What it does, per op (``bench/kernel_cases/<op>.py``, its ``rows("aot")``: the benchmark's shapes and the constexpr
branches the bench does not reach) and per dtype:

1. **Record the launches.** The op's forward and backward run through the registered op
   (``torch.ops.depthrewrite.<op>`` under ``kernel_backend("triton")``) on *fake* CUDA tensors
   (``FakeTensorMode``: no memory, no GPU), with ``torch.cuda``'s device queries answering for an H100/A100
   (capability 9.0 / 8.0, 132 / 108 SMs), so the launchers pick the tiles, warps and stages they pick on that GPU at
   that shape and dtype (bf16 included: no interpreter is involved). A dispatch mode runs each ``depthrewrite::`` op's
   Python implementation instead of its fake, and ``triton.runtime.jit.JITFunction.run`` is replaced by a recorder:
   each launch's kernel, arguments (tensors become ``triton.runtime.jit.MockTensor``: dtype only, pointers assumed
   16-byte aligned, as the JIT finds them for fresh allocations) and options (``num_warps``, ``num_stages``) are kept
   and nothing runs. Kernels are found through the launches, never by name.
2. **Compile.** Each distinct launch is specialised by the JIT's own binder for the target (so ints equal to 1 become
   constexprs and multiples of 16 get the divisibility hint, exactly as at run time; tuple arguments are handled by
   the same code) and compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` (ptxas
   ships with Triton).
3. **Report** registers and spill store/load bytes (``ptxas -v``: Triton's own ptxas report, or ptxas run on the
   PTX when Triton took the kernel from its cache), stack frame, local and shared memory (``cuobjdump
   --dump-resource-usage`` from Triton's ``backends/nvidia/bin``; shared against the arch's per-block limit) and
   compile time, one line per (op, kernel, arch, dtype, config), then one line per kernel.

Exit status 1 if any kernel spills (spill stores or local bytes > 0), needs more shared memory than the arch has, or
fails to compile. Run it outside ``TRITON_INTERPRET=1`` (it re-executes itself without it). Takes a few minutes on two cores;
see docs/kernels.md ("Ahead-of-time compile check").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings
from typing import Any

from bench.kernel_cases import OPS  # every op with a case module (bench/kernel_cases/<op>.py)

#: spill-store bytes per thread a configuration may have and still pass: up to 4 spilled registers (L1-resident) cost
#: less than the extra launch or the smaller tile that would remove them; anything larger fails the check
SPILL_TOLERANCE = 16

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# per-arch device facts the launchers may query: (SM count, max shared memory per block in bytes)
ARCHS = {80: (108, 163 * 1024), 90: (132, 227 * 1024)}


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch (arguments with tensors replaced by MockTensors)."""

    op: str
    row: str
    dtype: str
    kernel: Any  # the JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclasses.dataclass
class Result:
    op: str
    kernel: str
    arch: int
    dtype: str
    config: str
    regs: int | None = None
    spills: int | None = None  # ptxas -v: bytes of spill stores (spill loads are reported alongside)
    spill_loads: int | None = None
    stack: int | None = None
    local: int | None = None
    shared: int | None = None
    seconds: float = 0.0
    rows: list[str] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and (self.spills or 0) <= SPILL_TOLERANCE and not self.local
                and (self.shared or 0) <= ARCHS[self.arch][1])


# ---- 1. recording ---------------------------------------------------------------------------------------------------


def _mock(v):
    """Fake tensors → MockTensor (dtype and shape only); tuples/lists recursively; everything else as is."""
    import torch
    from triton.runtime.jit import MockTensor

    if isinstance(v, torch.Tensor):
        return MockTensor(v.dtype, list(v.shape))
    if isinstance(v, (tuple, list)):
        return type(v)(_mock(x) for x in v)
    return v


@contextlib.contextmanager
def _fake_gpu(arch: int):
    """torch.cuda's device queries answer for one GPU of capability ``arch`` (no GPU needed)."""
    import torch

    sms, smem = ARCHS[arch]
    props = types.SimpleNamespace(
        name=f"fake sm_{arch}", major=arch // 10, minor=arch % 10, multi_processor_count=sms,
        total_memory=80 * 2**30, shared_memory_per_block_optin=smem, max_shared_memory_per_block_optin=smem,
        L2_cache_size=50 * 2**20, warp_size=32, regs_per_multiprocessor=65536,
    )
    fakes = {
        "current_device": lambda: 0,
        "get_device_capability": lambda *a, **k: (arch // 10, arch % 10),
        "get_device_properties": lambda *a, **k: props,
        "get_device_name": lambda *a, **k: props.name,
    }
    old = {k: getattr(torch.cuda, k) for k in fakes}
    from depthrewrite.kernels import dispatch

    def clear_caches():  # dispatch caches the capability per device index
        for v in vars(dispatch).values():
            if callable(getattr(v, "cache_clear", None)):
                v.cache_clear()

    clear_caches()
    try:
        for k, f in fakes.items():
            setattr(torch.cuda, k, f)
        yield
    finally:
        for k, f in old.items():
            setattr(torch.cuda, k, f)
        clear_caches()


def _run_python_impls(forward_calls: list | None):
    """A dispatch mode that runs each ``depthrewrite::`` custom op's Python implementation (the launchers) instead of
    its fake, so that under FakeTensorMode the launchers run on fake tensors. Calls of ops with a registered autograd
    formula are appended to ``forward_calls`` (when given) as ``(opdef, inputs, output)``."""
    from torch._library.custom_ops import OPDEFS
    from torch.utils._python_dispatch import TorchDispatchMode

    class RunImpl(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func._schema.name
            if name.startswith("depthrewrite::") and name in OPDEFS:
                opdef = OPDEFS[name]
                with self:  # nested depthrewrite ops run their launchers too
                    out = opdef._init_fn(*args, **kwargs)
                if forward_calls is not None and opdef._backward_fn is not None:
                    rest = [kwargs[a.name] if a.name in kwargs else a.default_value
                            for a in func._schema.arguments[len(args):]]
                    forward_calls.append((opdef, (*args, *rest), out))
                return out
            return func(*args, **kwargs)

    return RunImpl()


class _Ctx:
    """The ``ctx`` a custom op's ``setup_context`` / ``backward`` see (what torch.library passes them)."""

    def __init__(self, n_inputs: int):
        self.needs_input_grad = (True,) * n_inputs
        self.saved_tensors = ()

    def save_for_backward(self, *ts):
        self.saved_tensors = ts

    def mark_non_differentiable(self, *ts):
        pass

    def set_materialize_grads(self, value):
        pass


def _backward(forward_calls) -> None:
    """Run every recorded op's registered backward formula (in reverse order) on random output gradients. Autograd's
    engine cannot run on fake CUDA tensors without a GPU, so the formula is called the way torch.library's autograd
    wrapper calls it."""
    import torch

    for opdef, inputs, out in reversed(forward_calls):
        ctx = _Ctx(len(inputs))
        opdef._setup_context_fn(ctx, inputs, out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        opdef._backward_fn(ctx, *(torch.randn_like(o) for o in outs))


def record(op: str, dtype: str, arch: int) -> list[Launch]:
    """Every kernel launch of the forward and backward of ``op``'s ``rows("aot")`` at ``dtype`` on a fake GPU."""
    import torch
    import triton.runtime.jit as jit
    from torch._subclasses.fake_tensor import FakeTensorMode

    from depthrewrite.kernels.dispatch import kernel_backend

    mod = importlib.import_module(f"bench.kernel_cases.{op}")
    tdtype = getattr(torch, DTYPES[dtype])
    launches: list[Launch] = []
    current: dict[str, str] = {}

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(op, current["row"], dtype, self, _mock(args), _mock(kwargs)))
        return None

    orig = jit.JITFunction.run
    jit.JITFunction.run = run
    try:
        with _fake_gpu(arch), kernel_backend("triton"):
            for r in mod.rows("aot"):
                current["row"] = r.id
                calls: list = []
                with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
                    call = mod.call(r, "cuda", tdtype)
                    tensors = [t.detach() for t in call.tensors]
                    with torch.no_grad(), _run_python_impls(calls):
                        call.fn(*tensors)
                    with torch.no_grad(), _run_python_impls(None):
                        _backward(calls)
    finally:
        jit.JITFunction.run = orig
    return launches


# ---- 2. compiling ---------------------------------------------------------------------------------------------------


def specialise(launch: Launch, arch: int):
    """(signature, constexprs, attrs, options) as the JIT would build them for this launch on ``arch``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    for path, v in _walk(launch.args):
        if isinstance(v, (tuple, list)) and not v:
            raise TypeError(f"{launch.name}: empty tuple argument at {path}")
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", False))
    try:
        bound, spec, options = binder(*launch.args, **kwargs)
    except Exception as e:  # noqa: BLE001 - say which argument the binder could not type
        raise TypeError(
            f"{launch.name}: could not type its arguments for an AOT signature ({e!r}); arguments: "
            + ", ".join(f"{p.name}={type(v).__name__}" for p, v in zip(fn.params, launch.args))
        ) from e
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return signature, constexprs, attrs, options


def _walk(v, path=()):
    yield path, v
    if isinstance(v, (tuple, list)):
        for i, x in enumerate(v):
            yield from _walk(x, path + (i,))


def _config(launch: Launch, signature, constexprs, attrs=None) -> str:
    """The launch's tile configuration: its constexpr parameters (declared ``tl.constexpr``, not JIT
    specialisations), num_warps/num_stages and, after ``%16:``, the int arguments the JIT marked divisible by 16 (two
    launches with the same tiles can differ there)."""
    names = [p.name for p in launch.kernel.params if p.is_constexpr]
    vals = []
    for n in names:
        i = launch.kernel.arg_names.index(n)
        v = constexprs.get((i,))
        if isinstance(v, bool) or v is None:
            vals.append(f"{n}={int(v) if v is not None else 'None'}")
        elif isinstance(v, (int, float, str)):
            vals.append(f"{n}={v}")
    w, s = launch.kwargs.get("num_warps"), launch.kwargs.get("num_stages")
    vals.append(f"w{w if w is not None else 4}s{s if s is not None else 3}")
    div = [launch.kernel.arg_names[k[0]] for k, v in (attrs or {}).items()
           if len(k) == 1 and v and signature.get(launch.kernel.arg_names[k[0]]) in ("i32", "i64")]
    if div:
        vals.append("%16:" + ",".join(div))
    return " ".join(vals)


_CUOBJDUMP = None


def _resources(cubin: bytes) -> dict[str, int]:
    import triton

    global _CUOBJDUMP
    if _CUOBJDUMP is None:
        _CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    res = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    if "reg" not in res:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-500:]}")
    return res


def compile_one(launch: Launch, arch: int) -> tuple[str, Result, Any]:
    """Specialise one launch for ``arch``: (dedup key, result to fill, spec for :func:`build` or ``None`` on error)."""
    res = Result(launch.op, launch.name, arch, launch.dtype, "")
    try:
        signature, constexprs, attrs, options = specialise(launch, arch)
    except Exception as e:  # noqa: BLE001
        res.error = f"{type(e).__name__}: {e}"
        return f"{launch.name}-{arch}-err-{e}", res, None
    res.config = _config(launch, signature, constexprs, attrs)
    key = repr((launch.kernel.fn.__module__, launch.kernel.fn.__qualname__, arch, sorted(signature.items()),
                sorted((k, repr(v)) for k, v in constexprs.items()), sorted((k, repr(v)) for k, v in attrs.items()),
                options.num_warps, options.num_stages))
    return key, res, (signature, constexprs, attrs, options)


def _ptxas_report(log: str) -> tuple[int, int] | None:
    """(spill store bytes, spill load bytes) from a ``ptxas -v`` report, or None if there is none."""
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _run_ptxas(ptx: str, arch: int) -> str:
    """``ptxas -v`` on the PTX of a kernel Triton took from its cache (so it printed no report)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        r = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    return r.stdout + r.stderr


def build(launch: Launch, arch: int, res: Result, spec) -> None:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = spec
    t0 = time.perf_counter()
    try:
        log = io.StringIO()
        old = knobs.nvidia.dump_ptxas_log
        knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v's report when it runs ptxas (not on a cache hit)
        try:
            with contextlib.redirect_stdout(log):
                k = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                   target=GPUTarget("cuda", arch, 32), options=options.__dict__)
        finally:
            knobs.nvidia.dump_ptxas_log = old
        res.seconds = time.perf_counter() - t0
        report = _ptxas_report(log.getvalue()) or _ptxas_report(_run_ptxas(k.asm["ptx"], arch))
        r = _resources(k.asm["cubin"])
        res.regs, res.stack, res.local = r["reg"], r.get("stack", 0), r.get("local", 0)
        res.spills, res.spill_loads = report
        res.shared = int(getattr(k.metadata, "shared", 0) or r.get("shared", 0))
    except Exception as e:  # noqa: BLE001 - reported per kernel, the run goes on
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
        res.seconds = time.perf_counter() - t0


# ---- 3. driver ------------------------------------------------------------------------------------------------------


def check(ops=OPS, archs=(80, 90), dtypes=tuple(DTYPES), log=print, compile: bool = True) -> list[Result]:
    """Record, compile and measure every distinct launch; returns one Result per distinct compile (with
    ``compile=False``: record and specialise only, no registers)."""
    results: dict[str, Result] = {}
    for op in ops:
        for dtype in dtypes:
            for arch in archs:
                t0 = time.perf_counter()
                launches = record(op, dtype, arch)
                if not launches:
                    raise RuntimeError(f"{op} {dtype}: no Triton launch recorded (did the op fall back to its reference?)")
                n_new = 0
                for ln in launches:
                    key, res, spec = compile_one(ln, arch)
                    if key in results:
                        if ln.row not in results[key].rows:
                            results[key].rows.append(ln.row)
                        continue
                    res.rows.append(ln.row)
                    results[key] = res
                    n_new += 1
                    if spec is not None and compile:
                        build(ln, arch, res, spec)
                log(f"# {op} {dtype} sm_{arch}: {len(launches)} launches, {n_new} distinct compiles, "
                    f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return list(results.values())


def table(results: list[Result]) -> str:
    head = ("op", "kernel", "arch", "dtype", "config", "regs", "spill st/ld", "stack", "local", "shared", "compile s", "")
    lines = [head]
    for r in sorted(results, key=lambda r: (r.op, r.kernel, r.dtype, r.arch, r.config)):
        bad = "" if r.ok else ("ERROR " + r.error if r.error else "SPILLS" if (r.spills or 0) > SPILL_TOLERANCE or r.local else "SHARED>limit")
        lines.append((r.op, r.kernel, f"sm_{r.arch}", r.dtype, r.config, str(r.regs), f"{r.spills}/{r.spill_loads}",
                      str(r.stack), str(r.local), str(r.shared), f"{r.seconds:.1f}", bad))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def summary(results: list[Result]) -> str:
    """One line per kernel: for each (arch, dtype), the most registers and the most spill-store bytes over its configs,
    and in parentheses how many of its configs spill out of how many."""
    cols = sorted({(r.arch, r.dtype) for r in results}, key=lambda c: (c[0], list(DTYPES).index(c[1])))
    by: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        by.setdefault((r.op, r.kernel), []).append(r)
    head = ["op", "kernel"] + [f"sm_{a} {d}" for a, d in cols]
    lines = [head]
    for (op, k), rs in sorted(by.items()):
        cells = [op, k]
        for a, d in cols:
            xs = [r for r in rs if r.arch == a and r.dtype == d]
            if not xs:
                cells.append("-")
                continue
            if any(r.error for r in xs):
                cells.append("ERROR")
                continue
            n = sum(1 for r in xs if r.spills or r.local)
            cells.append(f"{max(r.regs or 0 for r in xs)}/{max(r.spills or 0 for r in xs)}" + (f" ({n}/{len(xs)})" if n else ""))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # @triton.jit must build JITFunctions: re-exec
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "bench.aot", *(argv if argv is not None else sys.argv[1:])],
                               env=env)
    p = argparse.ArgumentParser(prog="python -m bench.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    p.add_argument("--op", default=",".join(OPS), help=f"ops, comma-separated (default {','.join(OPS)})")
    p.add_argument("--dtype", default=",".join(DTYPES), help="dtypes, comma-separated (default fp32,fp16,bf16)")
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--cold", action="store_true",
                   help="compile into a fresh Triton cache (honest compile times; the default reuses ~/.triton/cache)")
    p.add_argument("--no-compile", action="store_true",
                   help="record the launches and build their signatures only (seconds; checks the capture, not ptxas)")
    a = p.parse_args(argv)
    ops = [o.strip() for o in a.op.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            p.error(f"unknown op {o!r} (one of {', '.join(OPS)})")
    archs = tuple(int(x) for x in a.arch.split(","))
    for x in archs:
        if x not in ARCHS:
            p.error(f"unknown arch {x} (one of {', '.join(map(str, ARCHS))})")
    dtypes = tuple(d.strip() for d in a.dtype.split(","))
    if a.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="depthrewrite-aot-")
    t0 = time.perf_counter()
    results = check(ops, archs, dtypes, compile=not a.no_compile)
    print(table(results))
    if not a.no_compile:
        print("\nper kernel: registers/spill-store bytes, the most over its configs (configs that spill / configs)\n")
        print(summary(results))
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results)} compiles, {len(bad)} failing (spills, shared memory over the limit or errors), "
          f"{time.perf_counter() - t0:.0f} s in all")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(dataclasses.asdict(r), ok=r.ok) for r in results], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
