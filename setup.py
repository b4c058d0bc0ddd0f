"""Package discovery for the `streamserve` distribution; everything else is in pyproject.toml.

`kernels/` and `sessions/` sit at the top of the repository but are installed as `streamserve.kernels`
and `streamserve.sessions` (DESIGN.md §1). `[tool.setuptools.packages.find]` cannot rename what it finds,
so this file finds the packages under each folder and names them by where they are installed: a new
module or subpackage under any of the three folders ships without an edit here. Data files under the
package folders (model assets, kernel configs, static files) reach the sdist through MANIFEST.in and
the wheel through `include-package-data`; tests/test_wheel.py checks both.
"""

from __future__ import annotations

from setuptools import find_packages, setup

# installed package name -> its folder in the repository (the same table as [tool.setuptools.package-dir])
PACKAGE_ROOTS = {"streamserve": "streamserve", "streamserve.kernels": "kernels", "streamserve.sessions": "sessions",
                 "streamserve.web": "clients/web"}


def discover_packages() -> list[str]:
    """Every regular package (a folder with __init__.py) under each root, by its installed name."""
    found: set[str] = set()
    for name, folder in PACKAGE_ROOTS.items():
        found.add(name)
        found.update(f"{name}.{sub}" for sub in find_packages(folder))
    return sorted(found)


setup(packages=discover_packages())
