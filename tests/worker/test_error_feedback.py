"""Specification of the island's error feedback: what a sparse push leaves out is carried, decayed, into the
fragment's next push, only a push the shard took changes the buffer, and the buffers a checkpoint saved come
back only where they fit the model."""

import pytest
import torch

from diloco.core.encoding import Encoding, decode, encode
from diloco.worker.error_feedback import DECAY, ErrorFeedback


def _sent(values: list[torch.Tensor], block_size: int = 4, top_k: int = 1) -> list[torch.Tensor]:
    """What the sparse bytes of `values` carry, as the shard decodes them."""
    return [
        decode(encode(v, Encoding.SPARSE, block_size, top_k), v.shape, Encoding.SPARSE, block_size, top_k)
        for v in values
    ]


def test_the_first_push_of_a_fragment_is_its_delta():
    feedback = ErrorFeedback()
    delta = [torch.tensor([1.0, 2.0, 3.0, 4.0])]
    compensated = feedback.compensated(0, delta)
    assert torch.equal(compensated[0], delta[0]) and compensated[0] is not delta[0]
    assert feedback.held_back(0) is None


def test_what_was_not_sent_is_held_back_and_added_decayed_to_the_next_delta():
    feedback = ErrorFeedback(decay=0.5)
    first = [torch.tensor([1.0, -8.0, 2.0, 0.5])]
    feedback.accepted(0, first, _sent(first))
    # One value of four is sent: -8 as -6 (two bits over its scale 4); the rest, and -8's error, stay.
    assert feedback.held_back(0)[0].tolist() == [1.0, -2.0, 2.0, 0.5]
    second = feedback.compensated(0, [torch.tensor([0.0, 0.0, 1.0, 0.0])])
    assert second[0].tolist() == [0.5, -1.0, 2.0, 0.25]


def test_every_value_is_sent_in_time_without_decay():
    """With no decay a value the top-k keeps passing over is still sent once the others are: the sum of what
    the shard received approaches the sum of the deltas."""
    feedback = ErrorFeedback(decay=1.0)
    delta = [torch.tensor([4.0, 3.0, 2.0, 1.0])]
    received = torch.zeros(4)
    rounds = 40
    for _ in range(rounds):
        compensated = feedback.compensated(0, delta)
        sent = _sent(compensated)
        feedback.accepted(0, compensated, sent)
        received += sent[0]
    # What was sent plus what is held back is exactly what was meant to be sent, and what is held back stays
    # bounded (a few rounds' worth), so what each coordinate received per round approaches its delta.
    assert torch.allclose(received + feedback.held_back(0)[0], rounds * delta[0], rtol=1e-5)
    assert torch.allclose(received / rounds, delta[0], atol=0.4)


def test_a_push_the_shard_did_not_take_leaves_the_buffer_as_it_was():
    """The island trains on from the same base, so its next delta contains the refused one again."""
    feedback = ErrorFeedback()
    first = [torch.tensor([1.0, -8.0, 2.0, 0.5])]
    feedback.accepted(0, first, _sent(first))
    held = [t.clone() for t in feedback.held_back(0)]
    feedback.compensated(0, [torch.ones(4)])  # encoded and pushed, then refused: no `accepted`
    assert torch.equal(feedback.held_back(0)[0], held[0])


def test_fragments_have_buffers_of_their_own():
    feedback = ErrorFeedback()
    delta = [torch.tensor([1.0, -8.0, 2.0, 0.5])]
    feedback.accepted(1, delta, _sent(delta))
    assert feedback.held_back(0) is None
    assert torch.equal(feedback.compensated(0, delta)[0], delta[0])
    assert torch.equal(feedback.compensated(1, delta)[0], delta[0] + DECAY * feedback.held_back(1)[0])


def test_a_delta_shaped_unlike_the_buffer_is_refused():
    feedback = ErrorFeedback()
    delta = [torch.ones(4)]
    feedback.accepted(0, delta, _sent(delta))
    with pytest.raises(ValueError, match="shaped unlike"):
        feedback.compensated(0, [torch.ones(5)])


@pytest.mark.parametrize("decay", [-0.1, 1.5])
def test_a_decay_outside_zero_to_one_is_refused(decay):
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(decay=decay)


def _held(fragments: int = 2) -> ErrorFeedback:
    """Buffers of a two-tensor fragment per index, after one accepted push each."""
    feedback = ErrorFeedback()
    for p in range(fragments):
        delta = [torch.arange(8.0) - p, torch.ones(2, 4) * (p + 1)]
        feedback.accepted(p, delta, _sent(delta))
    return feedback


SHAPES = {0: [torch.Size([8]), torch.Size([2, 4])], 1: [torch.Size([8]), torch.Size([2, 4])]}


def test_saved_buffers_restore_into_a_fresh_island_as_they_were():
    saved = _held().named()
    assert sorted(saved) == ["0.0", "0.1", "1.0", "1.1"]
    restored = ErrorFeedback()
    assert restored.restore(saved, SHAPES) == [0, 1]
    for p in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(restored.held_back(p), _held().held_back(p)))


def test_a_buffer_that_does_not_fit_its_fragment_is_not_restored():
    saved = _held().named()
    partial = {name: t for name, t in saved.items() if name != "1.1"}
    assert ErrorFeedback().restore(partial, SHAPES) == [0]
    reshaped = {**saved, "0.1": torch.ones(8)}
    assert ErrorFeedback().restore(reshaped, SHAPES) == [1]
    longer = {**saved, "0.2": torch.ones(3)}
    assert ErrorFeedback().restore(longer, SHAPES) == [1], "a fragment of more tensors is another model's"
    feedback = ErrorFeedback()
    assert feedback.restore({}, SHAPES) == [] and feedback.held_back(0) is None
