"""Properties of the field table under arbitrary values (hypothesis): every field of every header, set to a
value on or beyond its bounds or to anything its wire type carries, is either within its rule or refused by
the stream reader naming exactly that field, never another exception; and deltas of finite magnitudes up to
the float32 limit keep finite norms, and the bound beyond which a merge leaves them out is finite. On failure
hypothesis prints the falsifying example; `pytest --hypothesis-seed=N` replays a run's seed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.core import robust
from diloco.core.encoding import Encoding, encode, validated
from diloco.core.merge import delta_norm
from diloco.transport import fields
from diloco.transport.v1 import syncer_pb2 as pb
from diloco.transport.wire import WireError, parse_push_chunk, push_messages, read_push_stream, tensor_payloads

pytestmark = pytest.mark.fuzz

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(torch.finfo(torch.float32).max)
SCALARS = [
    (message, name, rule)
    for message, rules in fields.FIELDS.items()
    for name, rule in rules.items()
    if not isinstance(rule, fields.Repeated | fields.Nested | fields.Anything | fields.ReaderLimit)
]
WIRE_VALUES = {  # what each protobuf type carries, edge values included
    "double": st.floats(allow_nan=True, allow_infinity=True),
    "uint64": st.integers(0, fields.U64),
    "uint32": st.integers(0, fields.U32),
    "int64": st.integers(-fields.I64 - 1, fields.I64),
    "string": st.text(max_size=80),
    "enum": st.integers(-(2**31), 2**31 - 1),
}
_TYPES = {1: "double", 4: "uint64", 13: "uint32", 3: "int64", 9: "string", 14: "enum"}


def wire_values(message: str, name: str) -> st.SearchStrategy:
    field = pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    return WIRE_VALUES[_TYPES[field.type]]


@st.composite
def header_with_one_field_set(draw) -> tuple[pb.PushHeader, str, object]:
    """A valid push header with one of its scalar fields set to an edge of its rule or any wire value."""
    name, rule = draw(st.sampled_from([(n, r) for m, n, r in SCALARS if m == "PushHeader"]))
    valid, invalid = rule.edges()
    edges = [v for v in valid + invalid if _travels(v)]
    value = draw(st.sampled_from(edges) | wire_values("PushHeader", name))
    header = pb.PushHeader(island_id="a", tokens=10, inner_steps=1)
    setattr(header, name, value)
    return header, name, value


def _travels(value: object) -> bool:
    """Whether protobuf can hold `value` at all (an edge beyond the wire type never reaches a reader)."""
    return not isinstance(value, int) or -fields.I64 - 1 <= value <= fields.U64


@FUZZ
@given(header_with_one_field_set())
def test_every_push_header_field_is_within_its_rule_or_refused_naming_it(drawn):
    header, name, value = drawn
    try:
        fields.FIELDS["PushHeader"][name].check(value)
        within = True
    except ValueError:
        within = False
    payloads, blobs = tensor_payloads([("w", torch.zeros(4))], Encoding.FP32, 0)
    messages = [parse_push_chunk(m) for m in push_messages(header, payloads, blobs)]
    if within:
        read_push_stream(messages)
    else:
        with pytest.raises(WireError) as refused:
            read_push_stream(messages)
        assert refused.value.field == name and refused.value.message.startswith(f"PushHeader.{name}:")


@FUZZ
@given(st.sampled_from(SCALARS), st.data())
def test_every_rule_refuses_with_a_value_error_or_takes_what_its_wire_type_carries(scalar, data):
    message, name, rule = scalar
    value = data.draw(wire_values(message, name))
    try:
        rule.check(value)
    except ValueError:
        pass
    if isinstance(value, float) and not math.isfinite(value):
        with pytest.raises(ValueError):
            rule.check(value)


finite32 = st.floats(-F32_MAX, F32_MAX, width=32)


@FUZZ
@given(st.lists(st.lists(finite32, min_size=4, max_size=4), min_size=1, max_size=5), st.floats(0, 1e3))
def test_deltas_of_any_finite_magnitude_have_finite_norms_and_a_finite_outlier_bound(deltas, fragment_norm):
    """As a shard holds them: encoded (fp32 bytes as sent), their norms taken chunk by chunk from the bytes."""
    tensors = [torch.tensor(d, dtype=torch.float32) for d in deltas]
    held = [[validated(encode(t, Encoding.FP32, 4), t.shape, Encoding.FP32, 4)] for t in tensors]
    norms = [delta_norm(d, chunk=2) for d in held]
    assert all(math.isfinite(n) for n in norms)
    assert norms == pytest.approx([robust.norm([t]) for t in tensors])
    bound = robust.outlier_bound(norms, [1.0] * robust.HISTORY, lambda: fragment_norm)
    assert math.isfinite(bound) and bound >= 0
