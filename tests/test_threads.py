"""Concurrent first calls from threads (a server with a thread pool): captures run alone and never leak into other
threads' calls; calls that need no capture run concurrently."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model

SHAPES = [(1, 5), (2, 7), (3, 9), (4, 4), (2, 12), (5, 3), (3, 6), (1, 11)]


def _serve(model, inputs, rounds=1):
    """Call ``model`` from one thread per input at once; (outputs, tracebacks)."""
    outs, errs = {}, []
    start = threading.Barrier(len(inputs))

    def work(key):
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(rounds):
                    outs[key] = model(input_ids=inputs[key]).logits
        except Exception as e:  # noqa: BLE001 - every failure is reported
            import traceback

            errs.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")

    threads = [threading.Thread(target=work, args=(k,)) for k in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    return outs, errs


@pytest.mark.parametrize("scheme,opts", [("attnres", {"blocks": 2}), ("msar", {"blocks": 2})])
def test_eight_threads_first_calls_with_other_shapes(scheme, opts):
    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    g = torch.Generator().manual_seed(0)
    inputs = {s: torch.randint(0, 100, s, generator=g) for s in SHAPES}
    with torch.no_grad():
        want = {s: model(input_ids=x).logits for s, x in inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(model, scheme, **opts)
    outs, errs = _serve(conv, inputs)
    assert not errs, errs[0]
    for s in SHAPES:
        torch.testing.assert_close(outs[s], want[s], rtol=1e-4, atol=1e-4)
    assert len(dr.runtime.handle.state_of(conv).entries()) >= 2
    # every structure captured: the same calls again run concurrently, with no capture
    captures = dr.runtime.handle.state_of(conv).captures
    outs, errs = _serve(conv, inputs, rounds=3)
    assert not errs, errs[0]
    assert dr.runtime.handle.state_of(conv).captures == captures
    for s in SHAPES:
        torch.testing.assert_close(outs[s], want[s], rtol=1e-4, atol=1e-4)


def test_a_capture_does_not_block_its_own_nested_call():
    """A capture that calls the model (capture's eval check runs it) in the capturing thread goes through."""
    from depthrewrite.runtime.entries import LOCK as _LOCK

    with _LOCK.exclusive():
        with _LOCK.shared():
            with _LOCK.exclusive():
                pass


def test_two_threads_exporting_at_once_leave_exports_unpatched():
    """The capture patches export's autocast pass while it exports (module calls inside ``torch.autocast`` blocks).
    Two threads exporting at once, the first finishing first, used to restore each other's patch and leave it
    installed for good; it also acted on another thread's own export. It is installed once while any thread
    exports, acts only in those threads, and is gone when the last one finishes."""
    from torch._export.passes import replace_autocast_with_hop_pass as hop_pass

    from depthrewrite.passes.lower.module_calls import _KEEP_HERE, _autocast_regions_kept

    real = hop_pass.replace_autocast_with_hop_pass
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def a():
        with _autocast_regions_kept():
            a_in.set()
            b_in.wait(30)
        a_out.set()

    def b():
        a_in.wait(30)
        with _autocast_regions_kept():
            b_in.set()
            a_out.wait(30)
            seen["patched while b exports"] = hop_pass.replace_autocast_with_hop_pass is not real
            seen["acts in b"] = _KEEP_HERE.on

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    with _autocast_regions_kept():
        pass
    seen["acts here outside"] = getattr(_KEEP_HERE, "on", False)
    for t in threads:
        t.join(timeout=60)
    assert seen == {"acts here outside": False, "patched while b exports": True, "acts in b": True}
    assert hop_pass.replace_autocast_with_hop_pass is real
