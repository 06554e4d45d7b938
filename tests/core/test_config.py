import json

import pytest
from pydantic import ValidationError

from diloco.core.config import (
    CamelModel,
    Encoding,
    InnerOptimizerConfig,
    OuterOptimizerConfig,
    TrainingConfig,
)


def test_defaults():
    cfg = TrainingConfig()
    assert (cfg.inner_steps, cfg.fragments, cfg.overlap_steps, cfg.mix_alpha) == (100, 4, 5, 0.5)
    assert cfg.encoding is Encoding.INT4
    assert (cfg.block_size, cfg.quorum) == (128, 1)
    assert cfg.grace_seconds is None, "unset: the islands' slack sizes a merge's wait"
    assert (cfg.max_staleness, cfg.staleness_decay, cfg.radial_directional) == (4, 1.0, False)
    assert cfg.island_timeout_seconds == 60.0
    assert cfg.min_transfer_mbps == 0.5
    assert cfg.inner == InnerOptimizerConfig(
        lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, warmup_steps=0, grad_clip=1.0
    )
    assert cfg.outer == OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)


def test_every_field_has_a_description():
    for model in (TrainingConfig, InnerOptimizerConfig, OuterOptimizerConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_encodings_are_named_by_their_values():
    assert Encoding("int8") is Encoding.INT8


def test_camel_case_and_snake_case_are_both_accepted():
    camel = TrainingConfig.model_validate(
        {
            "innerSteps": 50,
            "overlapSteps": 2,
            "mixAlpha": 0.25,
            "islandTimeoutSeconds": 5,
            "inner": {"weightDecay": 0.0, "gradClip": 0.0},
        }
    )
    snake = TrainingConfig(
        inner_steps=50,
        overlap_steps=2,
        mix_alpha=0.25,
        island_timeout_seconds=5,
        inner=InnerOptimizerConfig(weight_decay=0.0, grad_clip=0.0),
    )
    assert camel == snake
    assert camel.inner_steps == 50 and camel.inner.weight_decay == 0.0


def test_dump_uses_camel_case_aliases():
    data = json.loads(TrainingConfig().to_json())
    assert {
        "innerSteps",
        "overlapSteps",
        "mixAlpha",
        "blockSize",
        "graceSeconds",
        "maxStaleness",
        "stalenessDecay",
        "radialDirectional",
        "islandTimeoutSeconds",
    } <= set(data)
    assert "warmupSteps" in data["inner"] and "weightDecay" in data["inner"]
    assert data["encoding"] == "int4"


def test_json_round_trip():
    cfg = TrainingConfig(
        inner_steps=64,
        fragments=8,
        overlap_steps=3,
        mix_alpha=0.0,
        encoding=Encoding.BF16,
        block_size=64,
        quorum=3,
        grace_seconds=0.5,
        max_staleness=2,
        staleness_decay=0.5,
        radial_directional=True,
        island_timeout_seconds=30.0,
        inner=InnerOptimizerConfig(lr=3e-4, warmup_steps=10),
        outer=OuterOptimizerConfig(lr=0.5, momentum=0.8, nesterov=False),
    )
    back = TrainingConfig.from_json(cfg.to_json())
    assert back == cfg
    assert back.encoding is Encoding.BF16


def test_frozen_and_unknown_fields_refused():
    cfg = TrainingConfig()
    with pytest.raises(ValidationError):
        cfg.inner_steps = 5
    with pytest.raises(ValidationError) as err:
        TrainingConfig.model_validate({"innerStep": 5})
    assert err.value.errors()[0]["loc"] == ("innerStep",)
    assert err.value.errors()[0]["type"] == "extra_forbidden"


def test_camel_model_is_the_shared_base():
    assert issubclass(TrainingConfig, CamelModel)
    assert CamelModel.model_config["extra"] == "forbid"


@pytest.mark.parametrize(
    ("data", "loc"),
    [
        ({"innerSteps": 0}, ("innerSteps",)),
        ({"fragments": 0}, ("fragments",)),
        ({"overlapSteps": -1}, ("overlapSteps",)),
        ({"mixAlpha": -0.1}, ("mixAlpha",)),
        ({"mixAlpha": 1.01}, ("mixAlpha",)),
        ({"encoding": "int2"}, ("encoding",)),
        ({"blockSize": 0}, ("blockSize",)),
        ({"quorum": 0}, ("quorum",)),
        ({"graceSeconds": -1}, ("graceSeconds",)),
        ({"maxStaleness": -1}, ("maxStaleness",)),
        ({"stalenessDecay": 0}, ("stalenessDecay",)),
        ({"stalenessDecay": 1.5}, ("stalenessDecay",)),
        ({"islandTimeoutSeconds": 0}, ("islandTimeoutSeconds",)),
        ({"inner": {"lr": 0}}, ("inner", "lr")),
        ({"inner": {"weightDecay": -0.1}}, ("inner", "weightDecay")),
        ({"inner": {"beta1": 1.0}}, ("inner", "beta1")),
        ({"inner": {"beta2": -0.5}}, ("inner", "beta2")),
        ({"inner": {"warmupSteps": -1}}, ("inner", "warmupSteps")),
        ({"inner": {"gradClip": -1}}, ("inner", "gradClip")),
        ({"outer": {"lr": -0.7}}, ("outer", "lr")),
        ({"outer": {"momentum": 1.0}}, ("outer", "momentum")),
    ],
)
def test_invalid_values_are_refused_naming_the_field(data, loc):
    with pytest.raises(ValidationError) as err:
        TrainingConfig.model_validate(data)
    errors = err.value.errors()
    assert len(errors) == 1
    assert errors[0]["loc"] == loc


def test_odd_block_size_is_refused_in_model_and_schema():
    with pytest.raises(ValidationError) as err:
        TrainingConfig.model_validate({"blockSize": 127})
    error = err.value.errors()[0]
    assert error["loc"] == ("blockSize",)
    assert "multiple of 2" in error["msg"]
    assert TrainingConfig.model_json_schema(by_alias=True)["properties"]["blockSize"]["multipleOf"] == 2


def test_fragments_may_not_exceed_inner_steps():
    with pytest.raises(ValidationError) as err:
        TrainingConfig(inner_steps=4, fragments=8, overlap_steps=0)
    msg = err.value.errors()[0]["msg"]
    assert "fragments" in msg and "innerSteps" in msg
    assert TrainingConfig(inner_steps=8, fragments=8, overlap_steps=0).fragments == 8


def test_overlap_must_end_before_next_fragment_is_due():
    with pytest.raises(ValidationError) as err:
        TrainingConfig(inner_steps=100, fragments=4, overlap_steps=25)
    msg = err.value.errors()[0]["msg"]
    assert "overlapSteps" in msg and "innerSteps // fragments" in msg and "25" in msg
    assert TrainingConfig(inner_steps=100, fragments=4, overlap_steps=24).overlap_steps == 24
    with pytest.raises(ValidationError):
        TrainingConfig(inner_steps=10, fragments=3, overlap_steps=3)
    assert TrainingConfig(inner_steps=10, fragments=3, overlap_steps=2).overlap_steps == 2


def test_from_json_refuses_invalid_documents():
    with pytest.raises(ValidationError) as err:
        TrainingConfig.from_json('{"innerSteps": 10, "fragments": 2, "overlapSteps": 5}')
    assert "overlapSteps" in err.value.errors()[0]["msg"]


def test_updated_is_a_validated_copy():
    cfg = TrainingConfig(inner_steps=16, fragments=4, overlap_steps=3, quorum=2)
    changed = cfg.updated(inner_steps=20, grace_seconds=0.5)
    assert (changed.inner_steps, changed.grace_seconds, changed.quorum, cfg.inner_steps) == (20, 0.5, 2, 16)
    with pytest.raises(ValidationError) as err:
        cfg.updated(overlap_steps=4)
    assert "overlapSteps (tau=4)" in err.value.errors()[0]["msg"]
