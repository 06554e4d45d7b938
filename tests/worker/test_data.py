import math
import sysconfig

import numpy as np
import pytest
import torch

from diloco.worker.data import (
    BatchSampler,
    evaluate,
    load_tokens,
    split_holdout,
    stdlib_corpus,
    stdlib_sources,
)
from diloco.worker.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stdlib_sources_are_sorted_and_skip_tests_and_packages():
    sources = stdlib_sources()
    assert len(sources) > 100
    relative = [p.relative_to(sysconfig.get_paths()["stdlib"]) for p in sources]
    assert [p.as_posix() for p in relative] == sorted(p.as_posix() for p in relative)
    assert all(p.suffix == ".py" for p in sources)
    for path in relative:
        assert not {"site-packages", "test", "tests", "idle_test"} & set(path.parts), path
    assert any(p.name == "os.py" for p in sources)


def test_embedded_corpus_is_deterministic_capped_python_bytes():
    corpus = stdlib_corpus(100_000)
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1 and corpus.numel() == 100_000
    assert torch.equal(corpus, stdlib_corpus(100_000))
    first = stdlib_sources()[0].read_bytes()[:1000]
    assert bytes(corpus[: len(first)].tolist()) == first
    assert b"def " in bytes(corpus.tolist())
    assert torch.equal(load_tokens(None, 5000), corpus[:5000])
    assert torch.equal(load_tokens("stdlib", 5000), corpus[:5000])


def test_default_corpus_is_about_eight_mib():
    assert load_tokens(None).numel() == 8 * 1024 * 1024


def test_bin_token_file_round_trips(tmp_path):
    tokens = np.array([0, 1, 255, 256, 50256, 65535], dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    loaded = load_tokens(str(path), 1 << 20)
    assert loaded.dtype == torch.int32 and loaded.tolist() == tokens.tolist()
    assert load_tokens(str(path), 7).tolist() == tokens[:3].tolist()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64, np.uint32])
def test_npy_token_file_round_trips(tmp_path, dtype):
    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6, 200], dtype=dtype)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    loaded = load_tokens(str(path), 1 << 20)
    assert not loaded.is_floating_point() and loaded.tolist() == tokens.tolist()
    assert load_tokens(str(path), 4 * np.dtype(dtype).itemsize).tolist() == tokens[:4].tolist()


def test_text_file_is_read_as_bytes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes("héllo\n".encode())
    assert load_tokens(str(path), 1 << 20).tolist() == list("héllo\n".encode())
    assert load_tokens(str(path), 2).tolist() == list(b"h\xc3")


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        load_tokens(str(tmp_path / "missing.bin"), 100)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(str(tmp_path / "empty.txt"), 100)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd"):
        load_tokens(str(tmp_path / "odd.bin"), 100)
    np.save(tmp_path / "floats.npy", np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match="integer"):
        load_tokens(str(tmp_path / "floats.npy"), 100)
    np.save(tmp_path / "negative.npy", np.array([1, -2], dtype=np.int64))
    with pytest.raises(ValueError, match="non-negative"):
        load_tokens(str(tmp_path / "negative.npy"), 100)
    with pytest.raises(ValueError, match="max_bytes"):
        load_tokens(None, 0)


def test_split_holdout_takes_the_tail():
    tokens = torch.arange(1000)
    train, heldout = split_holdout(tokens)
    assert train.tolist() == list(range(950)) and heldout.tolist() == list(range(950, 1000))
    train, heldout = split_holdout(tokens[:10], 0.01)
    assert train.numel() == 9 and heldout.tolist() == [9]
    with pytest.raises(ValueError):
        split_holdout(tokens, 1.0)
    with pytest.raises(ValueError, match="too few"):
        split_holdout(tokens[:1], 0.5)


def batches(sampler, count=3, size=8):
    return [sampler.next_batch(size) for _ in range(count)]


def test_sampler_windows_are_contiguous_in_range_and_shifted():
    tokens = torch.arange(500, dtype=torch.int32)
    inputs, targets = BatchSampler(tokens, 16, island=0, rank=0, num_ranks=1, seed=0).next_batch(64)
    assert inputs.shape == targets.shape == (64, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(inputs, inputs[:, :1] + torch.arange(16))
    assert inputs.min() >= 0 and targets.max() <= 499
    last_start = BatchSampler(tokens[:17], 16, 0, 0, 1, 0).next_batch(4)[0]
    assert torch.equal(last_start, torch.arange(16).expand(4, 16))


def test_sampler_streams_differ_across_islands_and_ranks_and_reproduce():
    tokens = torch.arange(100_000)
    streams = {
        key: batches(BatchSampler(tokens, 32, island=key[0], rank=key[1], num_ranks=2, seed=5))
        for key in [(0, 0), (0, 1), (1, 0), (1, 1), ("west", 0)]
    }
    firsts = [tuple(s[0][0][:, 0].tolist()) for s in streams.values()]
    assert len(set(firsts)) == len(firsts)
    again = batches(BatchSampler(tokens, 32, island=1, rank=1, num_ranks=2, seed=5))
    for (a_in, a_tg), (b_in, b_tg) in zip(streams[(1, 1)], again):
        assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
    other_seed = batches(BatchSampler(tokens, 32, island=1, rank=1, num_ranks=2, seed=6))
    assert not torch.equal(other_seed[0][0], again[0][0])


def test_sampler_errors():
    with pytest.raises(ValueError, match="context"):
        BatchSampler(torch.arange(16), 16, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="rank"):
        BatchSampler(torch.arange(100), 16, 0, 2, 2, 0)


def test_evaluate_is_deterministic_and_uniform_for_untrained_model():
    model = build_model("tiny", 0)
    _, heldout = split_holdout(load_tokens(None, 200_000))
    model.train()
    first = evaluate(model, heldout, 128, batch_size=4, windows=8)
    assert model.training
    model.eval()
    second = evaluate(model, heldout, 128, batch_size=4, windows=8)
    assert not model.training
    assert first == second
    assert first == pytest.approx(math.log(256), abs=0.5)
    assert evaluate(build_model("tiny", 1), heldout, 128, 4, 8) != first


def test_evaluate_uses_the_same_windows_as_a_manual_computation():
    model = build_model("tiny", 0)
    heldout = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(0))
    starts = torch.linspace(0, 1000 - 33, 6).long()
    windows = torch.stack([heldout[s : s + 33] for s in starts])
    with torch.no_grad():
        expected = sum(model(w[:, :-1], w[:, 1:])[1].item() for w in windows.split(3)) / 2
    assert evaluate(model, heldout, 32, batch_size=3, windows=6) == pytest.approx(expected, rel=1e-6)


def test_evaluate_measures_the_same_windows_whatever_the_batch_size():
    model = build_model("tiny", 0)
    heldout = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(0))
    by_batch = [evaluate(model, heldout, 32, batch_size=b, windows=6) for b in (1, 4, 6, 64)]
    assert by_batch == pytest.approx([by_batch[0]] * 4, rel=1e-6)
