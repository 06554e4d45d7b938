"""The package's layers (docs/architecture.md) hold: import-linter's contracts in pyproject.toml, checked on the
package laid out as it installs, and every module of the package placed in a layer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def installed_layout(into: Path) -> Path:
    """The package as pip installs it: `diloco/` with each mapped folder (operator/, syncer/, worker/) inside.

    import-linter walks one folder per package, so it cannot see the subpackages that pyproject.toml maps in
    from other folders of the repository; a copy laid out as installed shows it the whole package."""
    package_dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    ignore = shutil.ignore_patterns("__pycache__")
    for name, folder in sorted(package_dirs.items(), key=lambda item: item[0].count(".")):
        shutil.copytree(ROOT / folder, into / name.replace(".", "/"), ignore=ignore)
    return into


def layer_modules() -> set[str]:
    (layers,) = [c["layers"] for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return {module.strip() for layer in layers for module in layer.split("|")}


def test_every_import_keeps_to_the_layers(tmp_path):
    site = installed_layout(tmp_path)
    result = subprocess.run(
        [Path(sys.executable).parent / "lint-imports", "--config", ROOT / "pyproject.toml", "--no-cache"],
        cwd=site,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[result.stdout.find("Contracts") :] + result.stderr


def test_every_module_of_the_package_is_in_a_layer(tmp_path):
    package = installed_layout(tmp_path) / "diloco"
    modules = {path.stem for path in package.glob("*.py") if path.stem != "__init__"}
    subpackages = {path.parent.name for path in package.glob("*/__init__.py")}
    children = {f"diloco.{name}" for name in modules | subpackages}
    assert children == layer_modules()
