#!/usr/bin/env bash
# One prepared GPU run (under 9.5 minutes on an H200): the kernel tests natively (no interpreter), then the kernel and
# whole-model benchmarks and the overhead table. Runs from the source tree with the machine's own torch/triton (may be
# torch 2.11 + triton 3.6); nothing is installed. Results go to $OUT (default bench/out), at most 8 files (what a lent
# device machine sends back): env.txt, kernel-tests.txt, bench.txt, results.json, results.md, overhead.txt,
# overhead.json, torchao-float8.txt. Copy the figures into bench/RESULTS.md with the hardware and date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PY=${PYTHON:-python3}
{ $PY -c "import torch, triton
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi; } > "$OUT/env.txt" 2>&1
head -1 "$OUT/env.txt"
# Timeouts sum to under 9.5 minutes, so the whole script fits one device call (10 minutes at most) with a fresh
# machine's start; what a timeout cuts short still leaves its log (2026-12-04, H200: a first run cut off the kernel
# benchmarks after depth_attn and mhc, so msar and moda come first now).
# 1. kernel tests on the GPU (fp32 and bf16 against the references), all of them (no -x), on 8 workers: most of their
# time is Triton compiling one kernel per shape, on the CPU; the whole log comes back
timeout 150 $PY -m pytest -q -n 8 -rfE --tb=short tests/kernels -p no:cacheprovider > "$OUT/kernel-tests.txt" 2>&1
tail -3 "$OUT/kernel-tests.txt"
# 2. kernel benchmarks (bf16), then one whole-model training step per scheme
timeout 170 $PY -m bench.kernels --ops "${OPS:-msar,moda,depth_attn,mhc}" --dtype bf16 --rep 10 --out "$OUT" 2>&1 \
  | grep -v -i "warn" > "$OUT/bench.txt"
timeout 90 $PY -m bench.kernels --ops "" --model --dtype bf16 --rep 10 2>&1 | grep -v -i "warn" >> "$OUT/bench.txt"
tail -30 "$OUT/bench.txt"
# 3. the overhead table (bench.overhead): extra FLOPs/bytes per token counted from the step, next to measured eager
# step-time and peak-memory ratios, every scheme beside vanilla (compiled rows: run them off the clock with
# --schemes KEY, each costs a few inductor compiles)
timeout 120 $PY -m bench.overhead --device cuda --dtype bf16 --layers 8 --hidden 1024 --seq 1024 --batch 4 --rep 5 \
  --no-compile --json "$OUT/overhead.json" 2>&1 | grep -v -i "warn" > "$OUT/overhead.txt"
tail -25 "$OUT/overhead.txt"
# 3b. torchao float8 training through a converted model (skipped on CPU; needs compute capability >= 8.9 and
# torchao on the machine); ~1 minute. The lent H200's image has no torchao (2026-12-04): carry its wheel in .whl/
# (ignored by git; name .whl in the device call's carry), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0
if ! $PY -c "import torchao" 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchao-site .whl/torchao-*.whl \
    && export PYTHONPATH="/tmp/torchao-site:$PYTHONPATH"
fi
if $PY -c "import torchao" 2>/dev/null; then
  timeout 50 $PY -m pytest -q tests/test_torchao.py -k float8 -p no:cacheprovider 2>&1 | tail -15 \
    > "$OUT/torchao-float8.txt"
  tail -2 "$OUT/torchao-float8.txt"
fi
# 4. optional (AOT=1): the ahead-of-time compile check for sm_80 and sm_90 (registers, spills; needs no GPU, a few
# minutes of CPU: prefer running `python -m bench.aot` on any machine to spending device time on it)
if [ "${AOT:-0}" = "1" ]; then
  timeout 900 $PY -m bench.aot --json "$OUT/aot.json" > "$OUT/aot.txt" 2>&1
  tail -3 "$OUT/aot.txt"
fi
