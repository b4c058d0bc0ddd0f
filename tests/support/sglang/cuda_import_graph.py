"""Test scaffolding: reads SGLang's import graph on the CUDA path on a machine without a GPU, to choose what the
SGLang GPU check carries (benchmarks/sglang_gpu/wheels.txt) and what the CUDA shims (cuda_shims/) must stand in for.

    mkdir /tmp/sgl && (cd /tmp/sgl && unzip -q sglang-0.5.15-cp311-*.whl)     # the release, built for this Python
    PYTHONPATH=/tmp/sgl:tests/support/sglang/cuda_shims SGLANG_IS_FLASHINFER_AVAILABLE=false \\
        .venv-sglang/bin/python tests/support/sglang/cuda_import_graph.py --block xgrammar,llguidance,outlines

It reports CUDA present (torch.cuda.is_available, a Hopper device's capability and properties), so SGLang's
module-level `if is_cuda():` branches run; imports the modules a server start loads (HTTP server, tokenizer,
scheduler, model runner, Qwen3/Llama, the Triton attention backend, sampler, memory pools); and prints which failed
(a missing sgl_kernel/flashinfer name or module shows here), which shim patches applied, and the third-party
distributions imported that the GPU image's package list (/work/.library/device/KINDS.md) lacks: the candidates to
carry. `--block` hides installed packages, to see whether an import of them is optional. Only imports are seen:
a function-level import that runs at serving time is not (the GPU run is the check of those).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata as md
import sys
import traceback
from pathlib import Path
from typing import Any

MODULES = ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.tokenizer_manager",
           "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
           "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3", "sglang.srt.models.llama",
           "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
           "sglang.srt.model_executor.forward_batch_info", "sglang.srt.mem_cache.memory_pool", "sglang.launch_server")
# The GPU image's Python packages (KINDS.md, "Python packages already there", 2026-11-17), as distribution names.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split())


class _Props:
    major, minor, name, multi_processor_count = 9, 0, "NVIDIA H200", 132
    total_memory, L2_cache_size, warp_size = 140 * 2**30, 60 * 2**20, 32
    regs_per_multiprocessor, max_threads_per_multi_processor, shared_memory_per_block_optin = 65536, 2048, 232448


def report_cuda() -> None:
    """torch says a Hopper GPU is there (nothing runs on it: only module-level code is executed)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: _Props.name
    torch.cuda.get_device_properties = lambda *a, **k: _Props()
    torch.cuda.mem_get_info = lambda *a, **k: (130 * 2**30, 140 * 2**30)


def block(names: set[str]) -> None:
    """Installed top-level packages `names` look absent to the path finder (and to importlib.util.find_spec)."""
    original = importlib.machinery.PathFinder.find_spec.__func__

    def find_spec(cls: Any, fullname: str, path: Any = None, target: Any = None) -> Any:
        return None if fullname.split(".")[0] in names else original(cls, fullname, path, target)

    importlib.machinery.PathFinder.find_spec = classmethod(find_spec)  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", default="", help="comma-separated top-level packages to hide")
    args = p.parse_args()
    block({b for b in args.block.split(",") if b})
    report_cuda()
    failed = 0
    for name in MODULES:
        try:
            __import__(name)
            print(f"OK    {name}")
        except Exception as e:  # every module is tried; each failure is printed with where it came from
            failed += 1
            print(f"FAIL  {name}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-3)
    shims = sys.modules.get("sglang_cuda_shims")
    print("shim patches applied:", getattr(shims, "applied", "(sglang_cuda_shims not loaded)"))
    dists = md.packages_distributions()
    norm = {d: d.lower().replace("_", "-") for ds in dists.values() for d in ds}
    carry: dict[str, set[str]] = {}
    here = str(Path(__file__).parent / "cuda_shims")
    for top in {m.split(".")[0] for m in list(sys.modules)}:
        if (getattr(sys.modules.get(top), "__file__", None) or "").startswith(here):
            continue  # a stand-in of the shims (zstandard), not the installed distribution of that name
        for dist in dists.get(top, []):
            if norm[dist] not in IMAGE:
                carry.setdefault(f"{dist}=={md.version(dist)}", set()).add(top)
    print("imported, not in the GPU image:")
    for spec in sorted(carry, key=str.lower):
        print(f"  {spec:40} {' '.join(sorted(carry[spec]))}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
