#!/usr/bin/env bash
# Fetches the wheels the SGLang GPU check carries (wheels.txt beside this file: exact versions and sha256) into
# .whl-sglang/ at the repository root (git-ignored), through pip's configured index, for Python 3.12 on x86-64
# Linux (the GPU machine's Python), whatever Python runs here. Idempotent: a wheel already there is kept if its hash
# matches, and a wheel wheels.txt does not list is removed. Prints the count and total size; exits non-zero if a
# wheel is missing or has another hash.
#
#   benchmarks/sglang_gpu/fetch_wheels.sh        # then: bash benchmarks/sglang_gpu_check.sh on the GPU machine
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DEST="$ROOT/.whl-sglang"
mkdir -p "$DEST"

REQS="$(mktemp)"
trap 'rm -f "$REQS"' EXIT
# wheels.txt rows: name==version  bytes  sha256  why...  -> pip's hash-checking requirement lines
awk '!/^#/ && NF >= 3 { print $1 " --hash=sha256:" $3 }' "$HERE/wheels.txt" >"$REQS"

# pip matches each --platform tag exactly: these are the manylinux tags the wheels in wheels.txt carry.
PLATFORMS=()
for tag in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --require-hashes \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$DEST" -r "$REQS"

# exactly the listed wheels, each with its listed hash (pip checked the downloads; this also checks kept ones)
status=0
declare -A want
while read -r spec _ sha _; do
    want["$(echo "${spec%%==*}" | tr 'A-Z-' 'a-z_')-${spec##*==}"]="$sha"
done < <(grep -v '^#' "$HERE/wheels.txt" | awk 'NF >= 3')
for whl in "$DEST"/*.whl; do
    base="$(basename "$whl")"
    key="$(echo "$base" | cut -d- -f1 | tr 'A-Z-' 'a-z_')-$(echo "$base" | cut -d- -f2)"
    if [ -z "${want[$key]:-}" ]; then
        echo "removed (not in wheels.txt): $base" >&2; rm -f "$whl"; continue
    fi
    if [ "$(sha256sum "$whl" | cut -c1-64)" != "${want[$key]}" ]; then
        echo "sha256 mismatch: $base" >&2; status=1
    fi
    unset "want[$key]"
done
for key in "${!want[@]}"; do echo "missing: $key" >&2; status=1; done
count=$(find "$DEST" -name '*.whl' | wc -l)
bytes=$(find "$DEST" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s}')
echo "$count wheels, $bytes bytes ($(awk -v b="$bytes" 'BEGIN {printf "%.1f MB", b / 1e6}')) in $DEST"
exit $status
