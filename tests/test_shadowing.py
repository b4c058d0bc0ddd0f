"""The repository never shadows an installed package (issue 31).

transformers imports Hugging Face's `kernels` package; the repository's own `kernels/` folder (installed as
`streamserve.kernels`) must never be what `import kernels` finds, in the test process or in a `python -m` /
`python -c` started from the repository root, the way the README's commands and the tests start them.
"""

from __future__ import annotations

import importlib.util
import site
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_checkpoint

from streamserve.checkout import CHECKOUT, is_checkout, keep_installed_packages_first

ROOT = Path(__file__).resolve().parent.parent
SITE_DIRS = [Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages())]


def top_level_names(folder: Path) -> set[str]:
    """What `import NAME` could find in `folder`: modules (.py, extension modules) and regular packages. A folder
    without __init__.py is a namespace portion, which never wins over a regular package, so it does not count."""
    if not folder.is_dir():
        return set()
    names = set()
    for child in folder.iterdir():
        if child.is_dir() and (child / "__init__.py").is_file():
            names.add(child.name)
        elif child.suffix in (".py", ".so", ".pyd") and child.is_file():
            names.add(child.name.split(".")[0])
    return names


def is_site_dir(entry: str) -> bool:
    return Path(entry or ".").resolve() in SITE_DIRS


def test_kernels_is_the_installed_package_not_the_repository_folder() -> None:
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None, "Hugging Face's kernels (transformers needs it) is missing"
    assert Path(spec.origin).resolve().parent != ROOT / "kernels", f"`kernels` resolves to the repository: {spec}"
    assert Path(spec.origin).resolve().parent.parent in SITE_DIRS


def test_no_path_entry_ahead_of_site_packages_shadows_an_installed_module() -> None:
    first_site = next(i for i, entry in enumerate(sys.path) if is_site_dir(entry))
    ahead = sys.path[:first_site]
    assert all(Path(e or ".").resolve() != ROOT for e in ahead), f"the root is ahead of site-packages: {ahead}"
    installed = set().union(*(top_level_names(d) for d in SITE_DIRS))
    clashes = {entry: sorted(top_level_names(Path(entry or ".")) & installed) for entry in ahead}
    assert not {entry: names for entry, names in clashes.items() if names}, (
        f"these names on sys.path ahead of site-packages shadow installed ones: {clashes}")


def test_transformers_loads_a_tiny_checkpoint(tmp_path: Path) -> None:
    import torch
    import transformers

    make_checkpoint(tmp_path, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize("argv", [
    ["-c", "import streamserve, transformers.integrations.hub_kernels, kernels; print(kernels.__file__)"],
    ["-m", "streamserve.tools.random_checkpoint", "--arch", "llama", "--out", "{tmp}/ckpt", "--set",
     "num_hidden_layers=1", "--set", "hidden_size=32", "--set", "num_attention_heads=2", "--set",
     "num_key_value_heads=1", "--set", "intermediate_size=48", "--set", "vocab_size=300"],
])
def test_python_started_in_the_repository_root_imports_the_installed_kernels(argv: list[str], tmp_path: Path) -> None:
    """`python -c` and `python -m` put the current directory first on sys.path; from the root, importing
    streamserve moves it behind site-packages before transformers looks for `kernels`."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if argv[0] == "-c":
        assert Path(done.stdout.strip()).resolve().parent != ROOT / "kernels"
    else:
        assert (tmp_path / "ckpt" / "config.json").is_file()


def test_only_entries_naming_the_checkout_move(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert CHECKOUT == ROOT and is_checkout(ROOT)
    monkeypatch.chdir(ROOT)
    path = ["", "/usr/lib/python3", str(ROOT), str(ROOT / "tests"), "/elsewhere"]
    assert keep_installed_packages_first(path, ROOT)
    assert path == ["/usr/lib/python3", str(ROOT / "tests"), "/elsewhere", "", str(ROOT)]
    keep_installed_packages_first(path, ROOT)  # again: already behind everything, the order stays
    assert path == ["/usr/lib/python3", str(ROOT / "tests"), "/elsewhere", "", str(ROOT)]
    # a folder that is not this checkout (an installed wheel's site-packages has no pyproject.toml) is left alone
    other = ["", str(tmp_path)]
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    assert not keep_installed_packages_first(other, tmp_path) and other == ["", str(tmp_path)]
