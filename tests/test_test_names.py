"""Test modules in folders that are not packages are imported by their file name alone: two of the same name in
different folders stop collection on a clean clone (pytest's "import file mismatch"), however a warm checkout's
caches hide it."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_two_test_modules_outside_packages_share_a_name():
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            where[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
