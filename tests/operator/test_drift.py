from diloco.operator.drift import contains


def test_a_live_object_contains_what_was_applied_whatever_else_the_server_added():
    assert contains({"a": 1, "b": {"c": [1, {"d": 2, "e": 3}]}}, {"b": {"c": [1, {"d": 2}]}})


def test_a_changed_removed_or_shortened_value_is_drift():
    assert not contains({"b": {"c": [1]}}, {"b": {"c": [1, 2]}})
    assert not contains({"a": "x"}, {"a": "y"}) and not contains({}, {"a": None})


def test_quantities_compare_by_value():
    assert contains({"cpu": "1"}, {"cpu": "1000m"}) and not contains({"cpu": "1"}, {"cpu": "2"})
