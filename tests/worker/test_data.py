import math
import sysconfig

import numpy as np
import pytest
import torch

from diloco.worker.data import (
    DataPosition,
    IslandReader,
    epoch_order,
    evaluate,
    island_windows,
    load_position,
    load_tokens,
    save_position,
    split_holdout,
    stdlib_corpus,
    stdlib_documents,
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


def reader(tokens, context, shard=0, shards=1, rank=0, ranks=1, seed=0, position=None):
    return IslandReader(
        tokens,
        context,
        shard=shard,
        shards=shards,
        rank=rank,
        ranks=ranks,
        seed=seed,
        position=position or DataPosition(),
    )


def starts_read(reader, steps, batch_size):
    """The first token of every window the reader returns over `steps` batches."""
    return [int(s) for _ in range(steps) for s in reader.next_batch(batch_size)[0][:, 0]]


def test_windows_are_contiguous_shifted_and_one_context_apart():
    tokens = torch.arange(500, dtype=torch.int32)
    inputs, targets = reader(tokens, 16).next_batch(8)
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(inputs, inputs[:, :1] + torch.arange(16))
    order = epoch_order(500, 16, seed=0, epoch=0)
    assert set(((inputs[:, 0] - order.offset) % 16).tolist()) == {0}, "windows start on the epoch's grid"


def test_an_epoch_reads_every_window_once_and_islands_share_none():
    """Four islands read an epoch between them: each window once, by one island, in the epoch's order."""
    tokens = torch.arange(2_000)
    order = epoch_order(2_000, 16, seed=3, epoch=0)
    read = {shard: starts_read(reader(tokens, 16, shard, 4, seed=3), 1, order.order.size // 4) for shard in range(4)}
    every = [start for starts in read.values() for start in starts]
    assert len(every) == len(set(every)) == (order.order.size // 4) * 4
    for shard, starts in read.items():
        expected = [order.offset + w * 16 for w in island_windows(order, shard, 4)[: len(starts)]]
        assert starts == expected


def test_the_next_epoch_reorders_and_shifts_the_windows():
    tokens = torch.arange(1_000)
    first, second = epoch_order(1_000, 10, 7, 0), epoch_order(1_000, 10, 7, 1)
    assert (first.offset, first.order.tolist()) != (second.offset, second.order.tolist())
    assert epoch_order(1_000, 10, 7, 1).order.tolist() == second.order.tolist(), "a pure function of its inputs"
    one = reader(tokens, 10, seed=7)
    per_epoch = first.order.size
    starts_read(one, 1, per_epoch)
    assert one.position == DataPosition(0, per_epoch)
    starts_read(one, 1, 3)
    assert one.position == DataPosition(1, 3), "a batch that runs past the island's share goes on in the next epoch"


def test_the_ranks_of_an_island_read_disjoint_parts_of_its_batch_and_move_together():
    tokens = torch.arange(5_000)
    whole = starts_read(reader(tokens, 8, 1, 2, seed=2), 3, 6)
    ranks = [reader(tokens, 8, 1, 2, rank=r, ranks=2, seed=2) for r in range(2)]
    per_rank = [[int(s) for s in r.next_batch(3)[0][:, 0]] for r in ranks]
    assert per_rank[0] + per_rank[1] == whole[:6]
    assert ranks[0].position == ranks[1].position == DataPosition(0, 6)


def test_a_reader_from_a_position_reads_on_where_another_stopped():
    tokens = torch.arange(3_000)
    straight = starts_read(reader(tokens, 12, 2, 3, seed=1), 6, 4)
    first = reader(tokens, 12, 2, 3, seed=1)
    before = starts_read(first, 4, 4)
    after = starts_read(reader(tokens, 12, 2, 3, seed=1, position=first.position), 2, 4)
    assert before + after == straight


def test_a_saved_position_is_taken_up_only_for_the_same_data(tmp_path):
    path = tmp_path / "checkpoints" / "island-0-rank0.data.json"
    identity = {"tokens": 100, "context": 8, "seed": 0, "shard": 0, "shards": 2}
    assert load_position(path, identity) is None
    save_position(path, DataPosition(2, 17), identity)
    assert load_position(path, identity) == DataPosition(2, 17)
    assert load_position(path, identity | {"seed": 1}) is None, "a position in other data"
    assert load_position(path, identity | {"shards": 3}) == DataPosition(3, 0), "recut: the next epoch"
    path.write_text("{not json")
    assert load_position(path, identity) is None


def test_reader_errors():
    with pytest.raises(ValueError, match="context"):
        reader(torch.arange(16), 16)
    with pytest.raises(ValueError, match="out of range"):
        reader(torch.arange(100), 16, shard=2, shards=2)
    with pytest.raises(ValueError, match="too few"):
        reader(torch.arange(40), 16, shard=2, shards=3).next_batch(1)


def test_text_shards_are_read_in_path_order_and_tokenised_with_end_of_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from diloco.worker.tokenizer import STDLIB_BPE, end_of_text, load_tokenizer

    (tmp_path / "a.txt").write_text("def one():\n    return 1\n")
    (tmp_path / "b.jsonl").write_text('{"text": "import os"}\n{"text": "x = 2", "meta": 1}\n')
    pq.write_table(pa.table({"text": ["class C:\n    pass\n"], "id": [3]}), tmp_path / "c.parquet")
    tokenizer = load_tokenizer(STDLIB_BPE)
    eos = end_of_text(tokenizer)
    tokens = load_tokens(str(tmp_path), 1 << 20, tokenizer).tolist()
    documents = ["def one():\n    return 1\n", "import os", "x = 2", "class C:\n    pass\n"]
    expected = [i for d in documents for i in [*tokenizer.encode(d).ids, eos]]
    assert tokens == expected
    as_bytes = load_tokens(str(tmp_path), 1 << 20).tolist()
    assert bytes(as_bytes) == "".join(documents).encode(), "without a tokenizer, text is bytes"


def test_a_missing_text_field_is_named(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="no field 'text'"):
        load_tokens(str(tmp_path), 1000)
    assert bytes(load_tokens(str(tmp_path), 1000, text_field="content").tolist()) == b"x"


def test_the_embedded_corpus_reads_as_bpe_documents_for_the_larger_presets():
    from diloco.worker.tokenizer import STDLIB_BPE, load_tokenizer

    tokenizer = load_tokenizer(STDLIB_BPE)
    tokens = load_tokens(None, 20_000, tokenizer)
    documents = stdlib_documents(20_000)
    assert tokenizer.decode(tokens.tolist()) == "".join(documents)
    assert tokens.numel() < 20_000 / 2, "the BPE packs Python source into far fewer tokens than bytes"


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
