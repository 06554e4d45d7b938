"""The one table of every field of the contract (`transport.fields`): complete, each rule taking the values on
its bounds and refusing those beyond, and a message refused naming the first field out of its rule."""

from __future__ import annotations

import math

import pytest

from diloco.transport import fields
from diloco.transport.v1 import syncer_pb2 as pb

MESSAGES = {m.name: m for m in pb.DESCRIPTOR.message_types_by_name.values()}
RULES = [(message, name, rule) for message, rules in fields.FIELDS.items() for name, rule in rules.items()]


def test_every_field_of_every_message_has_a_rule_and_no_rule_names_a_field_that_is_gone():
    assert fields.FIELDS.keys() == MESSAGES.keys()
    for name, descriptor in MESSAGES.items():
        assert {f.name for f in descriptor.fields} == fields.FIELDS[name].keys(), name


def test_every_double_must_be_finite():
    for name, descriptor in MESSAGES.items():
        for field in descriptor.fields:
            if field.type == field.TYPE_DOUBLE:
                rule = fields.FIELDS[name][field.name]
                assert isinstance(rule, fields.Seconds), f"{name}.{field.name}"
                for value in (math.inf, -math.inf, math.nan):
                    with pytest.raises(ValueError):
                        rule.check(value)


@pytest.mark.parametrize("message, name, rule", RULES, ids=[f"{m}.{n}" for m, n, _ in RULES])
def test_each_rule_takes_its_bounds_and_refuses_what_lies_beyond(message, name, rule):
    valid, invalid = rule.edges()
    for value in valid:
        rule.check(value)
    for value in invalid:
        with pytest.raises(ValueError):
            rule.check(value)
    assert rule.describe()


def test_a_message_is_refused_naming_its_first_field_out_of_rule_nested_ones_by_their_path():
    header = pb.PushHeader(island_id="a", inner_steps=10, tokens=100)
    fields.check(header)
    header.tensors.add(name="w", shape=[4], dtype=pb.FLOAT32, encoding=pb.FP32)
    header.tensors.add(name="b", shape=[4], dtype=7, encoding=pb.FP32)
    with pytest.raises(fields.FieldError) as refused:
        fields.check(header)
    assert refused.value.path == "PushHeader.tensors[1].dtype"
    assert refused.value.field == "dtype"


def test_an_unset_optional_field_is_unknown_not_out_of_rule():
    fields.check(pb.PushHeader(island_id="a"))  # slack_seconds unset
    with pytest.raises(fields.FieldError, match="slack_seconds"):
        fields.check(pb.PushHeader(island_id="a", slack_seconds=-1.0))


def test_a_step_time_of_zero_means_not_measured_and_anything_else_must_be_a_step_a_model_can_take():
    rule = fields.FIELDS["PushHeader"]["step_seconds"]
    for value in (0.0, 1e-6, 0.25, 3600.0):
        rule.check(value)
    for value in (1e-300, 5e-324, -0.0 - 1e-9, 3600.5, math.inf, math.nan):
        with pytest.raises(ValueError):
            rule.check(value)
