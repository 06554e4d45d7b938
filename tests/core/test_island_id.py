"""Specification of the island id rule: what an island may call itself on the wire, and that every id the
operator, `diloco run` and the worker give an island keeps to it."""

import re
from pathlib import Path

import pytest

from diloco.api.job import DNS_LABEL, ISLAND_NAME_MAX
from diloco.core.config import TrainingConfig
from diloco.core.island_id import ISLAND_ID_MAX_CHARS, check_island_id
from diloco.local.launcher import RunPlan

VALID = [
    "a",
    "ddp",  # ddp: the id of the data-parallel baseline
    "island-0",
    "island-511",
    "Island_A.1",
    "0",
    "a" * ISLAND_ID_MAX_CHARS,
]
INVALID = {
    "empty": "",
    "one character too long": "a" * (ISLAND_ID_MAX_CHARS + 1),
    "50 KB": "a" * 50_000,
    "a space": "island a",
    "a slash": "island/a",
    "a colon": "island:a",
    "a newline": "island\n",
    "a NUL": "island\0",
    "non-ASCII": "île",
    "leading dash": "-island",
    "trailing dash": "island-",
    "leading dot": ".island",
    "trailing underscore": "island_",
}


@pytest.mark.parametrize("island", VALID)
def test_ids_of_letters_digits_and_inner_separators_are_taken(island):
    check_island_id(island)


@pytest.mark.parametrize("case", list(INVALID))
def test_other_ids_are_refused_with_the_rule_named(case):
    with pytest.raises(ValueError, match=f"at most {ISLAND_ID_MAX_CHARS} characters"):
        check_island_id(INVALID[case])


def test_every_island_name_a_job_admits_is_an_island_id():
    """The operator names an island by its spec name, a DNS-1035 label of at most ISLAND_NAME_MAX characters."""
    assert ISLAND_NAME_MAX <= ISLAND_ID_MAX_CHARS
    for name in ["a", "island-a", "x" * ISLAND_NAME_MAX, "a-" * (ISLAND_NAME_MAX // 2) + "b"]:
        assert re.match(DNS_LABEL, name)
        check_island_id(name)


def test_the_islands_of_diloco_run_have_island_ids():
    plan = RunPlan(mode="diloco", config=TrainingConfig(), out=Path("out"))
    for index in (0, 1, 511):
        check_island_id(plan.island_name(index))
