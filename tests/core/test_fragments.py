import itertools
import math

import pytest

from diloco.core.fragments import (
    Fragment,
    fragment_offset,
    fragments_due,
    owned_fragments,
    plan_fragments,
    resume_step,
    shard_of,
)


def gpt_shapes(layers=12, d=128, vocab=256, context=256):
    shapes = [("tok_emb.weight", (vocab, d)), ("pos_emb.weight", (context, d))]
    for i in range(layers):
        b = f"blocks.{i}"
        shapes += [
            (f"{b}.ln1.weight", (d,)),
            (f"{b}.ln1.bias", (d,)),
            (f"{b}.attn.qkv.weight", (3 * d, d)),
            (f"{b}.attn.qkv.bias", (3 * d,)),
            (f"{b}.attn.proj.weight", (d, d)),
            (f"{b}.attn.proj.bias", (d,)),
            (f"{b}.ln2.weight", (d,)),
            (f"{b}.ln2.bias", (d,)),
            (f"{b}.mlp.fc.weight", (4 * d, d)),
            (f"{b}.mlp.fc.bias", (4 * d,)),
            (f"{b}.mlp.proj.weight", (d, 4 * d)),
            (f"{b}.mlp.proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (vocab, d))]
    return shapes


def layers_of(fragment):
    return {int(name.split(".")[1]) for name in fragment.names if name.startswith("blocks.")}


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 12])
def test_gpt_fragments_are_balanced(p):
    shapes = gpt_shapes()
    sizes = [f.numel for f in plan_fragments(shapes, p)]
    # Layers split evenly, so the spread is at most the largest unlayered tensor (embedding/head).
    assert max(sizes) - min(sizes) <= max(math.prod(s) for n, s in shapes if not n.startswith("blocks."))
    if p <= 6:
        assert max(sizes) / min(sizes) < 1.1


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 12])
def test_every_tensor_exactly_once_in_model_order(p):
    shapes = gpt_shapes()
    frags = plan_fragments(shapes, p)
    order = {name: i for i, (name, _) in enumerate(shapes)}
    all_names = [n for f in frags for n in f.names]
    assert sorted(all_names) == sorted(order)
    for f in frags:
        assert list(f.names) == sorted(f.names, key=order.get)
    assert [f.index for f in frags] == list(range(p))
    size = {name: math.prod(shape) for name, shape in shapes}
    for f in frags:
        assert f.numel == sum(size[n] for n in f.names)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_fragments_are_strided_across_depth(p):
    frags = plan_fragments(gpt_shapes(layers=12), p)
    for f in frags:
        layers = layers_of(f)
        assert layers == {layer for layer in range(12) if layer % p == f.index}
        assert min(layers) < p and max(layers) >= 12 - p
        # a whole layer stays together
        assert all(sum(n.startswith(f"blocks.{layer}.") for n in f.names) == 12 for layer in layers)


def test_deterministic():
    shapes = gpt_shapes(layers=7)
    assert plan_fragments(shapes, 3) == plan_fragments(list(shapes), 3)


def test_layer_rank_is_numeric_and_uses_first_numeric_component():
    shapes = [
        ("layers.10.w", (1,)),
        ("layers.2.w", (1,)),
        ("enc.5.sub.0.w", (1,)),
        ("layers.7.w", (1,)),
    ]
    frags = plan_fragments(shapes, 2)
    # distinct layers in ascending order: 2, 5, 7, 10 -> ranks 0, 1, 2, 3
    assert frags[0].names == ("layers.2.w", "layers.7.w")
    assert frags[1].names == ("layers.10.w", "enc.5.sub.0.w")


def test_unlayered_tensors_go_largest_first_to_lightest_fragment():
    shapes = [("a", (10,)), ("b", (7,)), ("c", (5,)), ("d", (3,))]
    # a(10)->0, b(7)->1, c(5)->1 (7 < 10), d(3)->0 (10 < 12)
    assert plan_fragments(shapes, 2) == [
        Fragment(0, ("a", "d"), 13),
        Fragment(1, ("b", "c"), 12),
    ]


def test_unlayered_ties_break_by_model_order_and_lowest_fragment():
    shapes = [("x", (4,)), ("y", (4,)), ("z", (4,))]
    assert [f.names for f in plan_fragments(shapes, 2)] == [("x", "z"), ("y",)]


def test_unlayered_tensors_fill_the_light_fragments_after_layers():
    shapes = [("emb", (2, 3)), ("h.0.w", (10,)), ("h.1.w", (4,)), ("h.2.w", (3,)), ("norm", (1,))]
    # layers: 0 -> f0 (10), 1 -> f1 (4), 2 -> f0 (13); then emb(6) -> f1 (10), norm(1) -> f1 (10 < 13)
    assert plan_fragments(shapes, 2) == [
        Fragment(0, ("h.0.w", "h.2.w"), 13),
        Fragment(1, ("emb", "h.1.w", "norm"), 11),
    ]


def test_empty_fragments_are_filled_from_the_heaviest():
    shapes = [
        ("blocks.0.w", (4, 4)),
        ("blocks.0.b", (4,)),
        ("blocks.1.w", (4, 4)),
        ("blocks.1.b", (4,)),
        ("blocks.1.c", (2,)),
    ]
    # layers: f0 = 20, f1 = 22, f2 and f3 empty.
    # f2 takes blocks.1.c (smallest of heaviest f1, which drops to 20); f3 takes blocks.0.b (f0 wins the tie).
    assert plan_fragments(shapes, 4) == [
        Fragment(0, ("blocks.0.w",), 16),
        Fragment(1, ("blocks.1.w", "blocks.1.b"), 20),
        Fragment(2, ("blocks.1.c",), 2),
        Fragment(3, ("blocks.0.b",), 4),
    ]


def test_no_fragment_is_empty_when_fragments_equal_tensors():
    shapes = gpt_shapes(layers=2)
    frags = plan_fragments(shapes, len(shapes))
    assert all(len(f.names) == 1 for f in frags)
    assert sorted(n for f in frags for n in f.names) == sorted(n for n, _ in shapes)


def test_scalar_tensors_count_one_element():
    assert plan_fragments([("s", ()), ("v", (3,))], 1) == [Fragment(0, ("s", "v"), 4)]


@pytest.mark.parametrize(
    ("shapes", "p", "match"),
    [
        ([("a", (1,))], 0, "at least 1"),
        ([("a", (1,)), ("b", (1,))], 3, "exceeds the number of tensors"),
        ([("a", (1,)), ("a", (2,))], 1, "more than once"),
        ([("a", (2, -1))], 1, "negative dimension"),
    ],
)
def test_plan_errors(shapes, p, match):
    with pytest.raises(ValueError, match=match):
        plan_fragments(shapes, p)


def test_offsets():
    assert [fragment_offset(p, 100, 4) for p in range(4)] == [0, 25, 50, 75]
    assert [fragment_offset(p, 10, 3) for p in range(3)] == [0, 3, 6]


@pytest.mark.parametrize(("h", "p"), [(1, 1), (8, 1), (8, 2), (8, 4), (12, 3), (10, 3), (7, 4)])
def test_a_rejoining_island_resumes_at_the_last_merged_due_step(h, p):
    """In a lockstep job that has merged every due step up to `step`, the versions alone give back the last
    due step, so the rejoining island's next due fragments are exactly those the others wait on."""
    for step in range(0, 4 * h):
        versions = [sum(p_ in fragments_due(s, h, p) for s in range(1, step + 1)) for p_ in range(p)]
        last_due = max((s for s in range(1, step + 1) if fragments_due(s, h, p)), default=0)
        assert resume_step(versions, h, p) == last_due


def test_resume_step_needs_every_fragment_version():
    with pytest.raises(ValueError, match="expected 2 fragment versions"):
        resume_step([1], 10, 2)


@pytest.mark.parametrize(("h", "p"), [(1, 1), (8, 1), (8, 2), (8, 4), (8, 8), (12, 3), (10, 3), (7, 4)])
def test_every_fragment_due_once_per_window(h, p):
    for start in range(1, 3 * h + 1):
        due = [f for step in range(start, start + h) for f in fragments_due(step, h, p)]
        assert sorted(due) == list(range(p))


@pytest.mark.parametrize(("h", "p"), [(8, 2), (8, 4), (12, 3), (100, 4), (6, 6)])
def test_due_steps_are_spaced_h_over_p(h, p):
    due_steps = [step for step in range(1, 4 * h + 1) for _ in fragments_due(step, h, p)]
    assert len(due_steps) == len(set(due_steps))
    assert all(b - a == h // p for a, b in itertools.pairwise(due_steps))


def test_schedule_anchors():
    h, p = 100, 4
    assert fragments_due(100, h, p) == [0]
    assert fragments_due(200, h, p) == [0]
    first = {f: next(s for s in range(1, h + 1) if f in fragments_due(s, h, p)) for f in range(p)}
    assert first == {0: 100, 1: 75, 2: 50, 3: 25}
    assert fragments_due(1, h, p) == []
    assert fragments_due(5, 5, 1) == [0]


def test_schedule_errors():
    with pytest.raises(ValueError, match="step"):
        fragments_due(0, 10, 2)
    with pytest.raises(ValueError, match="inner_steps"):
        fragments_due(1, 0, 2)
    with pytest.raises(ValueError, match="num_fragments"):
        fragments_due(1, 10, 0)
    with pytest.raises(ValueError, match="fragment"):
        fragment_offset(2, 10, 2)


@pytest.mark.parametrize(("shards", "p"), [(1, 4), (2, 4), (3, 8), (5, 3)])
def test_shards_partition_the_fragments(shards, p):
    owned = [owned_fragments(s, shards, p) for s in range(shards)]
    assert sorted(f for fs in owned for f in fs) == list(range(p))
    for s, fs in enumerate(owned):
        assert fs == sorted(fs)
        assert all(shard_of(f, shards) == s for f in fs)


def test_shard_errors():
    with pytest.raises(ValueError):
        shard_of(1, 0)
    with pytest.raises(ValueError):
        owned_fragments(2, 2, 4)
    with pytest.raises(ValueError):
        owned_fragments(0, 0, 4)
