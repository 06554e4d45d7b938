"""Progress events: typed records that a worker appends one flushed JSON line at a time, and that the runner,
goodput accounting, the run predictor and the benchmarks read back, tolerating what a SIGKILL leaves."""

import pytest

from diloco.progress import (
    EVENT_KINDS,
    CheckpointEvent,
    DoneEvent,
    EvalEvent,
    LearnerTotals,
    MergeEvent,
    ProgressFollower,
    ProgressLineError,
    ProgressWriter,
    PushEvent,
    RoundEvent,
    Source,
    StartEvent,
    StepEvent,
    parse_line,
    read_events,
    to_line,
)

SOURCE = Source(island="island-1", rank=0, mode="diloco", pid=4242)
TOTALS = LearnerTotals(
    inner_steps=40,
    tokens=20480,
    syncs_pushed=8,
    syncs_merged=6,
    syncs_resynced=1,
    syncs_abandoned=1,
    syncs_failed=0,
    bytes_pushed=123456,
    bytes_pulled=234567,
    blocked_seconds=0.25,
)
ONE_OF_EACH = [
    StartEvent(100.0, SOURCE, step=10, world=2, versions=(3, 4)),
    StepEvent(101.5, SOURCE, step=11, loss=3.25, tokens=512, seconds=0.125, sync_seconds=0.0625),
    EvalEvent(102.0, SOURCE, step=20, loss=2.5),
    RoundEvent(103.0, SOURCE, fragment=1, began_at=15, outcome="MERGED", version=5),
    RoundEvent(103.5, SOURCE, fragment=0, began_at=20, outcome="ABANDONED", version=None),
    PushEvent(103.2, SOURCE, fragment=1, began_at=30, incarnation=7, base_version=5, sequence=12),
    MergeEvent(103.4, Source("shard-0", 0, "syncer", 99), fragment=1, version=6, pushes=(("island-1", 7, 5, 12),)),
    CheckpointEvent(104.0, Source("ddp", 1, "ddp", 77), step=50),
    DoneEvent(105.0, SOURCE, step=40, loss=2.0, learner=TOTALS),
    DoneEvent(105.0, Source("ddp", 1, "ddp", 77), step=40, loss=2.0),
]

# Lines as the workers write them (the records' format since before the records existed, with the data
# positions since the islands read their data in order): the records read them and write them back byte for
# byte.
HEADER = '"t": 1700000000.5, "island": "island-1", "rank": 0, "mode": "diloco", "pid": 4242'
WORKER_LINES = [
    f'{{"event": "start", {HEADER}, "step": 0, "world": 2, "versions": [0, 0], "device": "NVIDIA H100 80GB HBM3", '
    '"precision": "bf16", "flops_per_token": 745000000.0, "peak_flops": 989000000000000.0, "warm": false, '
    '"data_epoch": 0, "data_window": 48}\n',
    f'{{"event": "step", {HEADER}, "step": 1, "loss": 5.5, "tokens": 2048, "seconds": 0.5, "sync_seconds": 0.0, '
    '"tokens_per_second": 4096.0, "mfu": 0.42, "overran": false, "data_from": [0, 48], "data_to": [0, 56]}\n',
    f'{{"event": "eval", {HEADER}, "step": 20, "loss": 2.75}}\n',
    f'{{"event": "round", {HEADER}, "fragment": 0, "began_at": 10, "outcome": "MERGED", "version": 2}}\n',
    f'{{"event": "round", {HEADER}, "fragment": 1, "began_at": 15, "outcome": "FAILED", "version": null}}\n',
    f'{{"event": "push", {HEADER}, "fragment": 0, "began_at": 10, "incarnation": 3, "base_version": 1, '
    '"sequence": 1700000000000000000}\n',
    '{"event": "merge", "t": 1700000000.5, "island": "shard-0", "rank": 0, "mode": "syncer", "pid": 99, '
    '"fragment": 0, "version": 2, "pushes": [["island-1", 3, 1, 1700000000000000000], ["island-2", 3, 0, 5]], '
    '"landed": 1}\n',
    f'{{"event": "checkpoint", {HEADER}, "step": 50}}\n',
    f'{{"event": "done", {HEADER}, "step": 40, "loss": 2.5}}\n',
    f'{{"event": "done", {HEADER}, "step": 40, "loss": 2.5, "inner_steps": 40, "tokens": 81920, "syncs_pushed": 8, '
    '"syncs_merged": 7, "syncs_resynced": 0, "syncs_abandoned": 1, "syncs_failed": 0, "bytes_pushed": 1000, '
    '"bytes_pulled": 2000, "blocked_seconds": 0.0, "rounds_begun": 8, "round_inner_steps": 40}\n',
]


@pytest.mark.parametrize("event", ONE_OF_EACH, ids=lambda e: e.kind)
def test_every_kind_of_event_reads_back_as_the_record_that_was_written(event):
    line = to_line(event)
    assert line.endswith("\n") and "\n" not in line[:-1], "one event, one line"
    assert line.startswith(f'{{"event": "{event.kind}", "t": ')
    assert parse_line(line) == event


def test_every_kind_has_a_record():
    assert set(EVENT_KINDS) == {"start", "step", "eval", "round", "push", "merge", "checkpoint", "done"}
    assert {e.kind for e in ONE_OF_EACH} == set(EVENT_KINDS)


def test_a_line_written_before_data_positions_reads_as_the_start_of_the_data():
    """Runs from before islands read their data in order: their steps read as data position zero."""
    old = (
        f'{{"event": "step", {HEADER}, "step": 1, "loss": 5.5, "tokens": 2048, "seconds": 0.5, '
        '"sync_seconds": 0.0, "tokens_per_second": 4096.0, "mfu": 0.42, "overran": false}\n'
    )
    step = parse_line(old)
    assert isinstance(step, StepEvent) and step.data_from == step.data_to == (0, 0) and step.loss == 5.5


@pytest.mark.parametrize("line", WORKER_LINES, ids=lambda line: parse_line(line).kind)
def test_a_line_as_workers_write_it_reads_and_writes_back_byte_for_byte(line):
    assert to_line(parse_line(line)) == line


def test_the_done_event_of_a_diloco_worker_carries_its_learner_counters_and_data_parallel_none():
    diloco, ddp = parse_line(WORKER_LINES[-1]), parse_line(WORKER_LINES[-2])
    assert isinstance(diloco, DoneEvent) and diloco.learner is not None
    assert (diloco.learner.syncs_merged, diloco.learner.bytes_pulled) == (7, 2000)
    assert isinstance(ddp, DoneEvent) and ddp.learner is None


def test_fields_that_older_workers_did_not_write_read_as_their_defaults():
    old = [
        f'{{"event": "step", {HEADER}, "step": 1, "loss": 5.5, "tokens": 2048, "seconds": 0.5}}',
        f'{{"event": "round", {HEADER}, "fragment": 0, "began_at": 10, "outcome": "MERGED"}}',
        f'{{"event": "start", {HEADER}, "step": 0, "world": 2}}',
    ]
    step, round_, start = (parse_line(line) for line in old)
    assert isinstance(step, StepEvent) and step.sync_seconds == 0.0 and step.compute_seconds == 0.5
    assert step.tokens_per_second == 0.0 and step.mfu is None
    assert isinstance(round_, RoundEvent) and round_.version is None and round_.merged
    assert isinstance(start, StartEvent) and start.versions == () and start.device == ""
    assert start.flops_per_token == 0.0 and start.peak_flops is None


def test_a_step_computes_for_its_wall_time_less_its_time_blocked_on_a_sync():
    step = StepEvent(1.0, SOURCE, step=1, loss=1.0, tokens=1, seconds=0.5, sync_seconds=0.375)
    assert step.compute_seconds == 0.125
    assert StepEvent(1.0, SOURCE, step=1, loss=1.0, tokens=1, seconds=0.5, sync_seconds=0.75).compute_seconds == 0.0


def test_an_unknown_kind_is_refused_by_name_when_parsing_a_line():
    with pytest.raises(ProgressLineError, match="unknown event kind 'preempted'"):
        parse_line(f'{{"event": "preempted", {HEADER}}}')


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"event": "step", "t": 1.0, "isl', "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"event": "eval", "t": 1.0, "step": 1, "loss": 2.0}', "eval event without island, rank, mode, pid"),
        (f'{{"event": "eval", {HEADER}, "step": 1}}', "eval event: .*loss"),
        (f'{{"event": "checkpoint", {HEADER}, "step": 1, "shard": 3}}', "checkpoint event: .*shard"),
        (f'{{"event": "merge", {HEADER}, "fragment": 0, "version": 2, "pushes": [["a", 1]]}}', "merge event: "),
    ],
)
def test_a_line_that_holds_no_event_is_refused_with_the_reason(line, reason):
    with pytest.raises(ProgressLineError, match=reason):
        parse_line(line)


def test_the_writer_stamps_each_event_with_the_time_and_the_worker_and_flushes_it_at_once(tmp_path):
    path = tmp_path / "progress" / "island-1-rank0.jsonl"
    times = iter([10.0, 11.0])
    writer = ProgressWriter(path, SOURCE, clock=lambda: next(times))
    writer.write(StartEvent, step=0, world=2, versions=(0, 0))
    assert read_events(path.parent) == [StartEvent(10.0, SOURCE, step=0, world=2, versions=(0, 0))], (
        "on disk before the writer is closed: a SIGKILL loses nothing written"
    )
    writer.write(EvalEvent, step=5, loss=3.0)
    writer.close()
    assert read_events(path.parent)[-1] == EvalEvent(11.0, SOURCE, step=5, loss=3.0)


def test_a_sink_gets_each_event_with_or_without_a_file(tmp_path):
    seen = []
    with ProgressWriter(None, SOURCE, clock=lambda: 1.0, sink=seen.append) as writer:
        writer.write(EvalEvent, step=5, loss=3.0)
    assert seen == [EvalEvent(1.0, SOURCE, step=5, loss=3.0)] and list(tmp_path.iterdir()) == []


def test_a_relaunched_worker_appends_to_its_slots_file(tmp_path):
    path = tmp_path / "island-1-rank0.jsonl"
    with ProgressWriter(path, SOURCE, clock=lambda: 1.0) as first:
        first.write(CheckpointEvent, step=1)
    relaunched = Source(SOURCE.island, SOURCE.rank, SOURCE.mode, pid=SOURCE.pid + 1)
    with ProgressWriter(path, relaunched, clock=lambda: 2.0) as second:
        second.write(CheckpointEvent, step=1)
    assert [e.source.pid for e in read_events(tmp_path)] == [SOURCE.pid, SOURCE.pid + 1]


def test_a_worker_without_a_progress_file_writes_nothing(tmp_path):
    with ProgressWriter(None, SOURCE) as writer:
        writer.write(EvalEvent, step=5, loss=3.0)
    assert list(tmp_path.iterdir()) == []


def test_a_partial_last_line_is_ignored_until_it_is_complete(tmp_path):
    path = tmp_path / "island-1-rank0.jsonl"
    line = WORKER_LINES[1]
    path.write_text(line[:30])
    follower = ProgressFollower(tmp_path)
    assert follower.poll() == [] and read_events(tmp_path) == []
    with open(path, "a") as f:
        f.write(line[30:])
    assert follower.poll() == [parse_line(line)] == read_events(tmp_path)
    assert follower.skipped == [], "a line being written is not a bad line"


def test_the_follower_returns_each_event_once_as_files_grow_and_appear(tmp_path):
    follower = ProgressFollower(tmp_path)
    assert follower.poll() == [], "no files yet"
    first, second = tmp_path / "island-0-rank0.jsonl", tmp_path / "island-1-rank0.jsonl"
    first.write_text(WORKER_LINES[0] + WORKER_LINES[1])
    assert follower.poll() == [parse_line(WORKER_LINES[0]), parse_line(WORKER_LINES[1])]
    assert follower.poll() == [], "nothing new"
    with open(first, "a") as f:
        f.write(WORKER_LINES[2])
    second.write_text(WORKER_LINES[3])
    assert follower.poll() == [parse_line(WORKER_LINES[2]), parse_line(WORKER_LINES[3])], "file by file, by name"


def test_a_line_cut_short_by_a_kill_and_run_into_by_the_relaunch_is_skipped_with_its_reason(tmp_path):
    path = tmp_path / "island-1-rank0.jsonl"
    path.write_text(WORKER_LINES[0] + WORKER_LINES[1][:40] + WORKER_LINES[0] + WORKER_LINES[2])
    follower = ProgressFollower(tmp_path)
    assert follower.poll() == [parse_line(WORKER_LINES[0]), parse_line(WORKER_LINES[2])]
    (skipped,) = follower.skipped
    assert (skipped.path, skipped.line) == (path, 2) and skipped.reason.startswith("not JSON")
    assert len(read_events(tmp_path)) == 2


def test_an_unknown_kind_in_a_file_is_skipped_with_its_reason_and_the_rest_still_read(tmp_path):
    """A newer worker's kind must not stop the accounting of a run: the reader passes over it, saying why."""
    path = tmp_path / "island-1-rank0.jsonl"
    path.write_text(WORKER_LINES[1] + f'{{"event": "preempted", {HEADER}}}\n' + WORKER_LINES[2])
    follower = ProgressFollower(tmp_path)
    assert follower.poll() == [parse_line(WORKER_LINES[1]), parse_line(WORKER_LINES[2])]
    (skipped,) = follower.skipped
    assert skipped.line == 2 and "unknown event kind 'preempted'" in skipped.reason
    assert len(read_events(tmp_path)) == 2


def test_reading_a_folder_reads_every_progress_file_in_name_order(tmp_path):
    (tmp_path / "island-1-rank0.jsonl").write_text(WORKER_LINES[2])
    (tmp_path / "island-0-rank0.jsonl").write_text(WORKER_LINES[0] + WORKER_LINES[1])
    (tmp_path / "notes.txt").write_text("not a progress file\n")
    assert read_events(tmp_path) == [parse_line(line) for line in WORKER_LINES[:3]]
