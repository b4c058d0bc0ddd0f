"""The CMake flags that build llama.cpp at full strength on this CPU (`make llamacpp-venv` reads them).

    python benchmarks/llamacpp_flags.py    # e.g. -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON ...

Every x86 SIMD extension ggml can use that /proc/cpuinfo lists, named one by one, and AMX never: GGML_NATIVE would
also turn AMX on, whose path crashes on these machines. A flag for an extension the CPU lacks would make the build
die on its first such instruction (SIGILL): AVX-VNNI, for one, is on some of these machines and not on others, so
the list is read from the CPU the peer runs on, not written down. No dependencies: it runs before any venv exists.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flag -> ggml's CMake option
GGML_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
                "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: ggml's defaults
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cmake_flags(flags: set[str]) -> list[str]:
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}=ON" if f in flags else f"-D{opt}=OFF" for f, opt in GGML_OPTIONS.items())]


if __name__ == "__main__":
    print(" ".join(cmake_flags(cpu_flags())))
