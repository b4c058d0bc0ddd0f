#!/usr/bin/env bash
# Test scaffolding: builds the virtual environment in which the SGLang backend tests run a real SGLang server on a
# CPU (see README.md beside this file). Usage: tests/support/sglang/install.sh [VENV]   (default: .venv-sglang at
# the repository root, which .gitignore lists). Idempotent: an existing VENV is reused and topped up.
#
# Everything goes in with --no-deps from exact pins, so pip never resolves sglang's own requirements (which name
# CUDA-only wheels: flashinfer, sglang-kernel, cuda-python, the CUDA torch 2.13 and its nvidia-* wheels).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the sglang 0.5.21 wheel is cp311"'

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --no-deps --disable-pip-version-check)

# The four large wheels, hash-pinned. torch==2.13.0+cpu is the CPU build (sglang 0.5.21 pins torch==2.13.0; this
# machine's pip configuration finds the +cpu wheel on local disk). triton is imported at module load by sglang
# (never run on this CPU path); torchvision 0.28.0 (the release for torch 2.13) exists only as a CUDA build, whose
# compiled ops do not load against the CPU torch: shims/sglang_cpu_shims.py makes it importable anyway.
PINNED="$(mktemp)"
trap 'rm -f "$PINNED"' EXIT
cat >"$PINNED" <<'EOF'
sglang==0.5.21 --hash=sha256:96c029f75dec99baa33a5db3d41b1bebefdd6bcfba3a2f7c807fe1cf49a87c20
torch==2.13.0+cpu --hash=sha256:6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b
triton==3.8.0 --hash=sha256:68988ac85d5e7086baeda0ddc175af9667db7529b3c5e11a5c0601b8bef2200a
torchvision==0.28.0 --hash=sha256:7e80f543b22503d9415e126db5f0ff3917036925e38560ee6b9ae38c571a4002
EOF
"${PIP[@]}" --require-hashes -r "$PINNED"
"${PIP[@]}" -r "$HERE/requirements.txt"

# The shims: this folder's shims/ on the venv's path, and sglang_cpu_shims imported at interpreter start.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\nimport sglang_cpu_shims\n' "$HERE/shims" >"$SITE/sglang_cpu_shims.pth"

# Smoke check: the modules a server start imports, with the CPU engine on (what the tests set too).
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c '
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner
import sglang, torch
print(f"sglang {sglang.__version__} on torch {torch.__version__}: imports OK")'
