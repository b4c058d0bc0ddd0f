"""What users install: the sdist and the wheel of both distributions hold every module and data file.

Each distribution is built as a user's `pip install` would build it from the index (the sdist first, then
the wheel from the unpacked sdist), so a file missing from the sdist is missing from the wheel too.
`make wheel-check` then installs the wheels into fresh virtual environments and runs them.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "python"
# repository folder -> where its files are installed (DESIGN.md §1)
SERVER_TREES = {"streamserve": "streamserve", "kernels": "streamserve/kernels", "sessions": "streamserve/sessions",
                "clients/web": "streamserve/web"}
CLIENT_TREES = {"streamserve_client": "streamserve_client"}

pytestmark = pytest.mark.slow
Dist = tuple[set[str], set[str], dict[str, str]]  # sdist files, wheel files, wheel metadata


def source_files(root: Path, folders: list[str]) -> list[str]:
    """The files under `folders` (relative to `root`) that a checkout has: tracked ones and new ones git does
    not ignore (bytecode, caches and build output are ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *folders],
                             cwd=root, capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f and (root / f).is_file()]  # (deleted, not yet committed: gone)
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        files = [str(p.relative_to(root)) for f in folders for p in (root / f).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    assert files, f"no files under {folders} in {root}"
    return sorted(files)


def installed_name(path: str, trees: dict[str, str]) -> str:
    """Where a source file lands in the wheel: under the installed name of the longest tree holding it."""
    top = max((t for t in trees if path == t or path.startswith(t + "/")), key=len)
    return trees[top] + path[len(top):]


def build(project: Path, out: Path) -> Dist:
    """Build the sdist, then the wheel from it; -> (the sdist's files relative to its top folder, the wheel's,
    the text of the wheel's metadata files by name)."""
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(project)],
                   check=True, capture_output=True)
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    with tarfile.open(sdist) as tar:
        sdist_files = {m.name.partition("/")[2] for m in tar.getmembers() if m.isfile()}
    with zipfile.ZipFile(wheel) as z:
        wheel_files = {n for n in z.namelist() if not n.endswith("/")}
        metadata = {n.split("/")[1]: z.read(n).decode() for n in wheel_files if ".dist-info/" in n}
    return sdist_files, wheel_files, metadata


@pytest.fixture(scope="module")
def server_dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    return build(ROOT, tmp_path_factory.mktemp("server-dist"))


@pytest.fixture(scope="module")
def client_dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    return build(CLIENT, tmp_path_factory.mktemp("client-dist"))


def test_the_server_sdist_and_wheel_hold_every_module_and_data_file(server_dist: Dist) -> None:
    sdist, wheel, _ = server_dist
    files = source_files(ROOT, list(SERVER_TREES))
    assert any(f.startswith("streamserve/server/") for f in files) and any(f.endswith(".json") for f in files)
    assert not [f for f in files if f not in sdist], "missing from the sdist"
    missing = [f for f in files if installed_name(f, SERVER_TREES) not in wheel]
    assert not missing, f"missing from the wheel: {missing}"
    assert {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md"} <= sdist


def test_the_server_wheel_installs_only_the_streamserve_package(server_dist: Dist) -> None:
    """A top-level `kernels` would shadow the `kernels` package on PyPI; nothing else may ride along."""
    _, wheel, metadata = server_dist
    tops = {f.split("/")[0] for f in wheel}
    assert tops == {"streamserve", "streamserve-0.1.0.dist-info"}, tops
    assert not [f for f in wheel if "__pycache__" in f or f.endswith((".pyc", ".so"))]
    # the console script (`make wheel-check` runs `streamserve --help` from it) and the dependencies
    assert "streamserve = streamserve.cli:main" in metadata["entry_points.txt"]
    assert "Requires-Dist: aiohttp" in metadata["METADATA"] and "Requires-Dist: torch" in metadata["METADATA"]


def test_the_client_sdist_and_wheel_hold_every_module(client_dist: Dist) -> None:
    sdist, wheel, _ = client_dist
    files = source_files(CLIENT, list(CLIENT_TREES))
    assert "streamserve_client/py.typed" in files and "streamserve_client/channel.py" in files
    assert not [f for f in files if f not in sdist], "missing from the sdist"
    assert not [f for f in files if installed_name(f, CLIENT_TREES) not in wheel], "missing from the wheel"
    assert {f.split("/")[0] for f in wheel} == {"streamserve_client", "streamserve_client-0.1.0.dist-info"}
