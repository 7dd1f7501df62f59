"""depthrewrite::moda_attn's fused Triton kernels against the PyTorch reference: forward, every gradient (q, k, v,
depth_k, depth_v, λ, a learned additive mask), masks and soft-capping, GQA groups that are not powers of two, odd head
dims, the fallback boundary, and opcheck of both registered ops with the Triton backend forced.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes are tiny; on a
CUDA machine the same file runs the compiled kernels and adds fp16/bf16 (the interpreter has no bf16).

Tolerances (atol, rtol) per dtype are in TOL (output) and GRAD_TOL (gradients) below, in the style of Liger's tests
(platform-notes §12); half-precision gradients must also pass fla's RMS-ratio check (RMS_RATIO of the reference's RMS).
fp32 runs use true fp32 dot products (``input_precision="ieee"``), so only summation order differs from the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from depthrewrite.kernels.dispatch import kernel_backend
from depthrewrite.kernels.moda import fused, kernel_covers, moda_attn, moda_attn_backward, moda_attn_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
GRAD_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-2, rtol=5e-2),
    torch.bfloat16: dict(atol=1e-1, rtol=1e-1),
}
RMS_RATIO = {torch.float16: 0.005, torch.bfloat16: 0.01}  # fla uses 0.005; bf16 has 3 fewer mantissa bits
HALF = [
    pytest.param(dt, marks=pytest.mark.skipif(DEVICE == "cpu", reason="half types are tested on CUDA only"))
    for dt in (torch.float16, torch.bfloat16)
]


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused launchers' calls, to tell the kernel path from the reference fallback."""
    n = {"fwd": 0, "bwd": 0}
    fwd, bwd = fused.moda_attn_fwd, fused.moda_attn_bwd

    def f(*a, **k):
        n["fwd"] += 1
        return fwd(*a, **k)

    def b(*a, **k):
        n["bwd"] += 1
        return bwd(*a, **k)

    monkeypatch.setattr(fused, "moda_attn_fwd", f)
    monkeypatch.setattr(fused, "moda_attn_bwd", b)
    return n


def make(B, Hq, Hk, T, S, n, d, *, mask=None, mask_shape=None, lam=None, dtype=torch.float32, seed=0, dv=None):
    """Inputs for one call; q, k, v, depth slots (and λ, a float mask) require grad. ``dv``: the value head dim
    (default d; MLA's differs)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_()  # noqa: E731
    dv = d if dv is None else dv
    q, k, v = r(B, Hq, T, d), r(B, Hk, S, d), r(B, Hk, S, dv)
    Kd, Vd = r(B, T, n, Hk, d), r(B, T, n, Hk, dv)
    m = None
    shape = mask_shape or (T, S)
    if mask == "bool":
        m = (torch.rand(*shape, generator=g) > 0.3).to(DEVICE)
    elif mask == "add":
        m = torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()
    w = None
    if lam == "mixed":  # some negative (clamped to 0 forward, straight-through gradient), some > 1
        w = (torch.rand(Hq, generator=g) * 2 - 0.5).to(DEVICE).requires_grad_()
    elif lam == "zero":
        w = torch.zeros(Hq, device=DEVICE, requires_grad=True)
    return q, k, v, m, Kd, Vd, w


def _f32(t):
    return None if t is None else (t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t)


def check(inputs, scale, causal, softcap, dtype=torch.float32):
    """Kernel vs reference (the reference in fp32 on upcast inputs): output, then every gradient."""
    q, k, v, m, Kd, Vd, w = inputs
    with kernel_backend("triton"):
        out = moda_attn(q, k, v, m, Kd, Vd, w, scale, causal, 0.0, None, softcap)
    ref_in = [_f32(t) for t in inputs]
    ref = moda_attn_ref(*ref_in[:6], ref_in[6], scale, causal, 0.0, None, softcap)
    assert out.dtype == dtype and out.shape == (*q.shape[:3], v.shape[3]) and out.stride() == ref.stride()
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    ref_leaves = [t for t in ref_in if t is not None and t.requires_grad]
    with kernel_backend("triton"):
        got = torch.autograd.grad(out, leaves, go.to(dtype))
    want = torch.autograd.grad(ref, ref_leaves, go)
    names = [nm for nm, t in zip("q k v mask Kd Vd lam".split(), inputs) if t is not None and t.requires_grad]
    for nm, a, b, x in zip(names, got, want, leaves):
        assert a.shape == x.shape and a.dtype == x.dtype, nm
        torch.testing.assert_close(a.float(), b, **GRAD_TOL[dtype], msg=lambda s, nm=nm: f"d{nm}: {s}")
        if dtype != torch.float32:
            rms = (a.float() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)
            assert rms < RMS_RATIO[dtype], (nm, rms.item())


CASES = [
    # id: B, Hq, Hk, T, S, n, d, causal, mask, mask_shape, lam, softcap
    pytest.param(1, 2, 2, 19, 19, 1, 8, True, None, None, None, 0.0, id="mha-one-slot-causal"),
    pytest.param(2, 4, 2, 13, 21, 3, 5, False, "bool", (2, 1, 13, 21), "mixed", 0.0, id="gqa2-bool4d-S>T-odd-d"),
    pytest.param(1, 6, 2, 17, 17, 2, 12, True, "add", (17, 17), "mixed", 4.0, id="gqa3-learned-add2d-softcap"),
    pytest.param(1, 4, 1, 18, 18, 33, 20, True, "bool", (1, 18, 18), None, 0.0, id="mqa4-33-slots-bool3d"),
    pytest.param(1, 4, 2, 20, 9, 2, 16, True, None, None, "zero", 2.5, id="S<T-causal-lambda0-softcap"),
    pytest.param(1, 16, 1, 5, 7, 4, 4, False, "add", (1, 16, 1, 7), "mixed", 0.0, id="G16-one-token-per-block"),
]


@pytest.mark.parametrize("B, Hq, Hk, T, S, n, d, causal, mask, mask_shape, lam, softcap", CASES)
def test_fused_matches_reference(B, Hq, Hk, T, S, n, d, causal, mask, mask_shape, lam, softcap, calls):
    inputs = make(B, Hq, Hk, T, S, n, d, mask=mask, mask_shape=mask_shape, lam=lam, seed=T * 7 + n)
    check(inputs, 1.0 / math.sqrt(d), causal, softcap)
    assert calls == {"fwd": 2, "bwd": 1}  # the kernel path ran both ways (the backward recomputes the LSE)


@pytest.mark.parametrize("d, dv, mask, lam, softcap", [
    (24, 16, "bool", "mixed", 0.0),  # MLA (DeepSeek-V3): query/key head dim 24, value head dim 16
    (8, 20, "add", None, 3.0),  # values wider than the keys, padded to another power of two
])
def test_value_head_dim_differs_from_the_key_head_dim(d, dv, mask, lam, softcap, calls):
    inputs = make(2, 4, 2, 11, 11, 3, d, mask=mask, mask_shape=(2, 1, 11, 11), lam=lam, seed=d + dv, dv=dv)
    check(inputs, 1.0 / math.sqrt(d), True, softcap)
    assert calls == {"fwd": 2, "bwd": 1}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("causal, mask", [(True, None), (False, "bool")])
def test_fused_half_precision(dtype, causal, mask, calls):
    inputs = make(2, 8, 2, 77, 77, 8, 64, mask=mask, mask_shape=(2, 1, 77, 77), lam="mixed", dtype=dtype)
    check(inputs, 0.125, causal, 0.0, dtype)
    assert calls == {"fwd": 2, "bwd": 1}


def test_strided_inputs_and_stride0_grad(calls):
    """SDPA-style transposed q/k/v (``[B, T, H, d]`` in memory) and the stride-0 gradient of ``sum()``."""
    B, Hq, Hk, T, n, d = 2, 4, 2, 11, 2, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, Hq, d, generator=g).to(DEVICE).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, Hk, d, generator=g).to(DEVICE).transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, Hk, d, generator=g).to(DEVICE).transpose(1, 2).requires_grad_()
    Kd, Vd = (torch.randn(B, T, n, Hk, d, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    with kernel_backend("triton"):
        out = moda_attn(q, k, v, None, Kd, Vd, None, 0.3, True, 0.0, None, 0.0)
        got = torch.autograd.grad(out.sum(), (q, k, v, Kd, Vd))
    ref = moda_attn_ref(q, k, v, None, Kd, Vd, None, 0.3, True, 0.0, None, 0.0)
    want = torch.autograd.grad(ref.sum(), (q, k, v, Kd, Vd))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32])
    assert calls == {"fwd": 2, "bwd": 1}


def test_fully_masked_rows_keep_their_depth_slots(calls):
    """A row whose every sequence key is masked attends to its depth slots only (never empty, never NaN)."""
    q, k, v, _, Kd, Vd, _ = make(1, 2, 1, 6, 6, 3, 8)
    m = torch.ones(6, 6, dtype=torch.bool, device=DEVICE)
    m[2] = False
    with kernel_backend("triton"):
        out = moda_attn(q, k, v, m, Kd, Vd, None, 0.3, False, 0.0, None, 0.0)
    s = torch.einsum("hd,nd->hn", q[0, :, 2], Kd[0, 2, :, 0]) * 0.3
    want = s.softmax(-1) @ Vd[0, 2, :, 0]
    torch.testing.assert_close(out[0, :, 2], want, **TOL[torch.float32])
    assert torch.isfinite(out).all() and calls["fwd"] == 1


def test_lambda_zero_is_plain_attention(calls):
    """λ = 0 (preserve_init) gives SDPA's causal attention of the sequence part exactly (spec §8 Q8)."""
    q, k, v, _, Kd, Vd, w = make(1, 2, 2, 21, 21, 4, 16, lam="zero")
    with kernel_backend("triton"):
        out = moda_attn(q, k, v, None, 100 * Kd, Vd, w, 0.25, True, 0.0, None, 0.0)  # large depth logits, λ = 0
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25), atol=2e-5,
                               rtol=2e-5)


def test_fallback_boundary(calls):
    """Dropout, fp64 and head dims > 256 run the reference inside the op; head dim 256 and any G stay fused."""
    q, k, v, _, Kd, Vd, _ = make(1, 2, 1, 4, 4, 2, 8)
    seed = torch.tensor([3])
    with kernel_backend("triton"):
        out = moda_attn(q, k, v, None, Kd, Vd, None, 0.3, True, 0.5, seed, 0.0)
    ref = moda_attn_ref(q, k, v, None, Kd, Vd, None, 0.3, True, 0.5, seed, 0.0)
    assert torch.equal(out, ref)
    with kernel_backend("triton"):  # the backward op's written-out reference reproduces the seeded dropout masks
        got = torch.autograd.grad(out.square().sum(), (q, k, v, Kd, Vd))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v, Kd, Vd))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **GRAD_TOL[torch.float32])
    d64 = [t.detach().double() for t in (q, k, v, Kd, Vd)]
    with kernel_backend("triton"):
        moda_attn(d64[0], d64[1], d64[2], None, d64[3], d64[4], None, 0.3, True, 0.0, None, 0.0)
    assert calls["fwd"] == 0
    big = [torch.empty(s, device="meta") for s in ((1, 2, 3, 257), (1, 1, 3, 257), (1, 3, 2, 1, 257))]
    assert not kernel_covers(big[0], big[1], big[1], None, big[2], big[2], None, 0.0)
    ok = [torch.empty(s, device="meta") for s in ((1, 6, 3, 256), (1, 2, 3, 256), (1, 3, 2, 2, 256))]
    assert kernel_covers(ok[0], ok[1], ok[1], None, ok[2], ok[2], None, 0.0)
    assert not kernel_covers(ok[0], ok[1], ok[1], None, ok[2], ok[2], None, 0.1)  # dropout
    assert not kernel_covers(ok[0], ok[1], ok[1], torch.empty(3, 5, dtype=torch.bool), ok[2], ok[2], None, 0.0)


def test_opcheck_forward_and_backward_ops():
    q, k, v, m, Kd, Vd, w = make(1, 4, 2, 5, 5, 2, 4, mask="add", lam="mixed")
    with kernel_backend("triton"):
        torch.library.opcheck(moda_attn, (q, k, v, m, Kd, Vd, w, 0.5, True, 0.0, None, 2.0))
        out = moda_attn(q, k, v, m, Kd, Vd, w, 0.5, True, 0.0, None, 2.0).detach()
        go = torch.randn_like(out).expand_as(out)
        torch.library.opcheck(
            moda_attn_backward,
            (go, *(t.detach() for t in (q, k, v, m, Kd, Vd, w)), out, 0.5, True, 0.0, None, 2.0, True),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


def test_backward_op_returns_the_kernel_grads_without_a_copy(monkeypatch):
    """The backward op returns the launcher's gradients as they are when they already have the dtype, shape and
    strides of the fake's ``empty_like(input)``, and copies into that layout otherwise (transposed q, k, v here)."""
    seen = []
    bwd = fused.moda_attn_bwd

    def spy(*a, **kw):
        seen.append(bwd(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(fused, "moda_attn_bwd", spy)
    q, k, v, m, Kd, Vd, w = (None if t is None else t.detach() for t in make(1, 4, 2, 5, 5, 2, 4, lam="mixed"))
    with kernel_backend("triton"):
        out = moda_attn(q, k, v, m, Kd, Vd, w, 0.5, True, 0.0, None, 0.0)
        go = torch.randn_like(out)
        res = moda_attn_backward(go, q, k, v, m, Kd, Vd, w, out, 0.5, True, 0.0, None, 0.0, False)
        kern = seen[-1]
        for i in (0, 1, 2, 4, 5):  # dq, dk, dv, dKd, dVd
            assert res[i] is kern[i]
        qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        res = moda_attn_backward(go, qt, kt, vt, m, Kd, Vd, w, out, 0.5, True, 0.0, None, 0.0, False)
        kern = seen[-1]
    for i, x in zip((0, 1, 2), (qt, kt, vt)):
        assert res[i] is not kern[i] and res[i].stride() == x.stride()
        torch.testing.assert_close(res[i], kern[i], rtol=0, atol=0)
    assert res[4] is kern[4] and res[5] is kern[5]


def test_compiled_graphs_show_one_opaque_node_each_way():
    """AOT autograd (what torch.compile runs) sees one moda_attn in the forward graph, one moda_attn_backward in the
    backward graph, and the compiled call matches eager."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    q, k, v, _, Kd, Vd, w = make(1, 4, 2, 6, 6, 2, 8, lam="mixed")
    fn = lambda *a: moda_attn(*a[:3], None, *a[3:], 0.3, True, 0.0, None, 0.0)  # noqa: E731
    with kernel_backend("triton"):
        out = aot_function(fn, fw_compiler=keep, bw_compiler=keep)(q, k, v, Kd, Vd, w)
        out.square().sum().backward()
    fw, bw = graphs
    count = lambda gm, name: sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))  # noqa: E731
    assert count(fw, "moda_attn.") == 1 and count(bw, "moda_attn_backward") == 1 and count(bw, "moda_attn.") == 0
    torch.testing.assert_close(out, moda_attn_ref(q, k, v, None, Kd, Vd, w, 0.3, True, 0.0, None, 0.0), **TOL[torch.float32])


_SM90_SCRIPT = r"""
import os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from depthrewrite.kernels.moda import fused as F

ONE = {"sqd", "skd", "svd", "sdd", "sed", "sod", "sgd", "sms"}  # unit strides: the JIT specialises them the same way
CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def build(fn, ptrs, consts, warps, stages):
    consts = dict(consts, **{n: 1 for n in fn.arg_names if n in ONE})
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("scale", "softcap") else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n] not in ("constexpr", "fp32")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([CUOBJ, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", out).group(1))


for dt, d, G, mk in [("bf16", 128, 4, 0), ("bf16", 64, 4, 1), ("fp16", 128, 3, 2)]:
    c = F.block_config(G, d, getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dt]))
    P, mptr = "*" + dt, {0: "*" + dt, 1: "*u8", 2: "*" + dt}[mk]
    com = dict(GP=c["GP"], BD=c["BD"], BDV=c["BDV"], MASK_KIND=mk, CAUSAL=mk != 1, SOFTCAP=mk == 1, DOT_PREC="tf32")
    io = dict(Q=P, K=P, V=P, KD=P, VD=P, LAM="*fp32", MASK=mptr, LSE="*fp32", DELTA="*fp32", DO=P, DQ=P, DKD=P,
              DVD=P, DLAM="*fp32", DS="*fp32", DK=P, DV=P)
    stacks = [
        build(F.moda_attn_fwd_kernel, dict(io, O=P), dict(com, BMT=c["fwd_BMT"], BN=c["fwd_BN"], HAS_LAM=True, STATS_ONLY=False),
              c["fwd_warps"], c["fwd_stages"]),
        build(F.moda_attn_bwd_kernel_dq, io, dict(com, BMT=c["dq_BMT"], BN=c["dq_BN"], HAS_LAM=True, STORE_DS=mk == 2),
              c["dq_warps"], c["dq_stages"]),
        build(F.moda_attn_bwd_kernel_dkdv, io, dict(com, BMT=c["kv_BMT"], BN=c["kv_BN"]), c["kv_warps"], c["kv_stages"]),
    ]
    assert stacks == [0, 0, 0], (dt, d, G, mk, stacks)
print("ok")
"""


@pytest.mark.skipif(not __import__("os").environ.get("DEPTHREWRITE_SM90_COMPILE"),
                    reason="opt-in (about a minute): DEPTHREWRITE_SM90_COMPILE=1")
def test_kernels_compile_for_sm90_without_spills():
    """Ahead-of-time compile of the three kernels for sm_90 (no GPU needed; ptxas ships with Triton): catches what the
    interpreter cannot (type errors of loop-carried values, fp64 literals) and register spills of the bf16/fp16 tiles."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
