#!/usr/bin/env bash
# The prepared SGLang GPU check (issue 18, item 4): on one CUDA GPU with a preinstalled torch and no package index,
# SGLang 0.5.15 from carried wheels serves a tiny random Qwen3 with its Triton attention; the session probe and the
# streamserve parity run (benchmarks/sglang_gpu/probe.py) run against it; everything is logged under $OUT.
#
# Here, first (once; ~43 MB into the git-ignored .whl-sglang/, through pip's index):
#     benchmarks/sglang_gpu/fetch_wheels.sh
# Then the device run (the device tool's `run`; the script keeps itself inside 7 minutes, the rest is margin):
#     run(command="bash benchmarks/sglang_gpu_check.sh", carry=[".whl-sglang"], timeout_s=480)
# Back under $OUT: check.log (this script), probe.log, sglang.log (SGLang's own output), result.json; the last
# line printed is one JSON object ("ok": every check passed).
#
# Without a GPU it does nothing useful; `python benchmarks/sglang_gpu/probe.py --cpu ...` proves the probe's logic
# on a CPU against the CPU recipe (docs/scale.md).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
BUDGET_S="${BUDGET_S:-420}"  # 7 minutes for the whole script
OUT="${OUT:-/tmp/sglang_gpu_check}"
WHEELS="${WHEELS:-$ROOT/.whl-sglang}"
PY="${PYTHON:-python3}"
SITE=/tmp/site      # the carried wheels
SRC=/tmp/ss-src     # streamserve from this working tree, laid out as installed (kernels/ -> streamserve.kernels)
CKPT=/tmp/sglang-gpu-ckpt
mkdir -p "$OUT"
exec > >(tee -a "$OUT/check.log") 2>&1
left() { echo $((BUDGET_S - SECONDS)); }
say() { echo "[$(printf '%4d' "$SECONDS")s] $*"; }
finish() {  # the last line: one JSON object
    "$PY" - "$1" "$OUT/result.json" "$SECONDS" <<'PY'
import json, sys
stage, path, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    result = json.load(open(path))
except (OSError, ValueError):
    result = {"ok": False}
result = {k: v for k, v in result.items() if k not in ("probe", "parity")}
ok = bool(result.get("ok")) and not stage
print(json.dumps({**result, "ok": ok, "failed_stage": stage or None, "script_s": seconds}))
PY
    exit 0
}

say "SGLang GPU check: budget ${BUDGET_S}s, out $OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || say "no nvidia-smi"
ldd --version | head -1   # the sglang wheel is manylinux_2_34: glibc >= 2.34
"$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, torch.cuda.is_available(), "triton", triton.__version__); assert torch.cuda.is_available()' \
    || finish "torch with CUDA"

# 1. the carried wheels, exactly those of wheels.txt, into /tmp/site (ahead of the image's packages on the path)
want=$(grep -v '^#' benchmarks/sglang_gpu/wheels.txt | awk 'NF >= 3' | wc -l)
have=$(find "$WHEELS" -maxdepth 1 -name '*.whl' 2>/dev/null | wc -l)
say "wheels: $have in $WHEELS, wheels.txt lists $want"
[ "$have" -eq "$want" ] || finish "wheels missing: carry .whl-sglang (benchmarks/sglang_gpu/fetch_wheels.sh)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || finish "pip install"
say "installed into $SITE ($(du -sh "$SITE" | cut -f1))"

# 2. streamserve from this tree: a folder of links shaped like the installed package (setup.py's PACKAGE_ROOTS)
rm -rf "$SRC" && mkdir -p "$SRC/streamserve"
for entry in streamserve/*; do ln -s "$ROOT/$entry" "$SRC/streamserve/"; done
ln -s "$ROOT/kernels" "$SRC/streamserve/kernels"
ln -s "$ROOT/sessions" "$SRC/streamserve/sessions"
ln -s "$ROOT/clients/web" "$SRC/streamserve/web"
export PYTHONPATH="$SITE:$SRC:$ROOT/tests/support/sglang/cuda_shims${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_IS_FLASHINFER_AVAILABLE=false SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# 3. the imports a server start needs, with the CUDA shims (a missing module shows here in seconds, not after a
# failed server start). From /tmp: `python -c` puts its cwd first on the path, and this tree's own streamserve/
# folder (without kernels/ inside) would shadow the laid-out one.
cd /tmp || exit 1
timeout 150 "$PY" -W ignore -c '
import importlib.metadata as md, sglang_cuda_shims, torch
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner
import sglang.srt.models.qwen3, sglang.srt.layers.attention.triton_backend, sglang.srt.layers.sampler
import streamserve.engine, streamserve.engine.remote, streamserve.kernels
print("imports OK: sglang", md.version("sglang"), "transformers", md.version("transformers"), "tokenizers",
      md.version("tokenizers"), "torch", torch.__version__, "patched", sglang_cuda_shims.applied)
' || finish "imports"
say "imports checked; $(left)s left"
cd "$ROOT" || exit 1

# 4. probe and parity (the probe starts and stops SGLang itself, skipping what would not fit)
rm -rf "$CKPT"
timeout $(( $(left) - 10 )) "$PY" benchmarks/sglang_gpu/probe.py --out "$OUT" --ckpt "$CKPT" \
    --deadline-s $(( $(left) - 25 )) --start-timeout-s 200
rc=$?
say "probe exited with status $rc"
[ "$rc" -eq 0 ] || finish "probe (status $rc)"
finish ""
