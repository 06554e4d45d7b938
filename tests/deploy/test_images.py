"""The container images' assumptions, checked without Docker: each Dockerfile builds from the named base, runs
as uid 10001 and copies only what the build context admits; the operator image installs the pinned subset of
pyproject.toml that the operator imports, and nothing else it imports is missing there.
(`make images` builds and smoke-tests the real images; it is too slow for CI.)"""

import importlib.metadata as metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.operator", "Dockerfile.trainer"]
_loader = importlib.util.spec_from_file_location("requirements", ROOT / "deploy" / "images" / "requirements.py")
image_requirements = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(image_requirements)
_loader = importlib.util.spec_from_file_location("context", ROOT / "deploy" / "images" / "context.py")
build_context = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(build_context)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def copied_sources(dockerfile: str) -> list[str]:
    """The context paths a Dockerfile's COPY lines read (not those copied from another stage)."""
    sources = []
    for line in (ROOT / "deploy" / dockerfile).read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return sources


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_build_from_the_named_base_and_run_as_uid_10001(name):
    text = (ROOT / "deploy" / name).read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=", text, re.M)
    stages = ["${PYTHON_IMAGE}"]
    for line in text.splitlines():
        if line.startswith("FROM"):
            words = line.split()
            assert words[1] in stages, f"{name}: {line} starts from neither the base nor an earlier stage"
            stages += words[3:4]
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert not re.search(r"^# *syntax=", text, re.M), "a syntax directive makes BuildKit pull a frontend image"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_everything_a_dockerfile_copies_is_in_the_build_context(name):
    rules = build_context.ignore_rules(ROOT)
    sources = copied_sources(name)
    assert "pyproject.toml" in sources and "deploy/images/requirements.py" in sources
    for source in sources:
        concrete = source.replace("wheel[s]", "wheels")
        assert build_context.admitted(concrete, rules), f"{name} copies {source}, which .dockerignore leaves out"
        assert concrete == "wheels" or (ROOT / concrete).exists(), f"{name} copies {source}, which does not exist"
    assert not build_context.admitted(".venv", rules) and not build_context.admitted("out/run/loss.png", rules)


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_each_image_installs_exact_pins_from_pyproject(image):
    installed = image_requirements.requirements(PYPROJECT, image)
    assert f"requirements.py {image}" in (ROOT / "deploy" / f"Dockerfile.{image}").read_text()
    assert installed and set(installed) <= set(PYPROJECT["project"]["dependencies"])
    assert all("==" in requirement for requirement in installed)
    names = {image_requirements.name_of(r) for r in installed}
    assert ("torch" in names) == (image == "trainer")


def test_requirements_refuse_an_unpinned_dependency_or_a_missing_operator_one():
    unpinned = {"project": {"dependencies": ["kopf>=1.0", "torch==2.15.0"]}}
    with pytest.raises(ValueError, match="kopf>=1.0"):
        image_requirements.requirements(unpinned, "trainer")
    without_kopf = {
        "project": {
            "dependencies": [r for r in PYPROJECT["project"]["dependencies"] if image_requirements.name_of(r) != "kopf"]
        }
    }
    with pytest.raises(ValueError, match="kopf"):
        image_requirements.requirements(without_kopf, "operator")


def closure(names: list[str]) -> set[str]:
    """The installed distributions `names` pull in, transitively (what pip puts in the operator image)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = image_requirements.name_of(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def test_the_operator_imports_nothing_its_image_lacks():
    in_image = closure(image_requirements.requirements(PYPROJECT, "operator")) | {"diloco", "pip", "setuptools"}
    providers = metadata.packages_distributions()
    blocked = sorted(
        module for module, dists in providers.items() if not {image_requirements.name_of(d) for d in dists} & in_image
    )
    assert {"torch", "numpy", "matplotlib", "grpc_health"} <= set(blocked)
    code = (
        f"import importlib, pkgutil, sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
        "import diloco.operator as op\n"
        "for module in pkgutil.iter_modules(op.__path__):\n"
        "    importlib.import_module(f'diloco.operator.{module.name}')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_the_source_label_changes_with_the_sources_and_the_dockerfile_only(tmp_path):
    (tmp_path / "deploy" / "images").mkdir(parents=True)
    (tmp_path / ".dockerignore").write_text((ROOT / ".dockerignore").read_text())
    for path in ["pyproject.toml", "README.md", "deploy/Dockerfile.trainer", "deploy/images/requirements.py"]:
        (tmp_path / path).write_text(path)
    (tmp_path / "diloco" / "__pycache__").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "diloco" / "core.py").write_text("step = 1\n")
    assert build_context.context_files(tmp_path) == [
        "README.md",
        "deploy/images/requirements.py",
        "diloco/core.py",
        "pyproject.toml",
    ]
    built = build_context.digest(tmp_path, "trainer")

    (tmp_path / "diloco" / "__pycache__" / "core.pyc").write_bytes(b"\0")
    (tmp_path / "wheels" / "torch.whl").write_bytes(b"\0")
    (tmp_path / "notes.txt").write_text("not in the context")
    assert build_context.digest(tmp_path, "trainer") == built

    for path in ["diloco/core.py", "deploy/Dockerfile.trainer"]:
        (tmp_path / path).write_text("changed")
        assert build_context.digest(tmp_path, "trainer") != built
        built = build_context.digest(tmp_path, "trainer")
