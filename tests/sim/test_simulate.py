"""`diloco simulate` end to end with small settings: what it prints and what it writes."""

import csv

import pytest

from diloco.cli import main
from diloco.local.failure_trace import FailureEvent, load_trace, save_trace
from diloco.sim.engine import SIM_TRAINING, Policy, SimConfig, simulate
from diloco.sim.simulate import sweep

SMALL = [
    "--chips",
    "20000,40000",
    "--islands",
    "4",
    "--seeds",
    "2",
    "--horizon-hours",
    "2",
    "--mtbi-years",
    "0.1",
    "--jobs",
    "1",
    "--no-progress",
]


def rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_writes_table_plot_and_report(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", *SMALL, "--out", str(out), "--model-params", "7e10", "--link-mbps", "2000"]) == 0
    printed = capsys.readouterr().out
    assert "Goodput (%) against fleet size" in printed and "| 20,000 |" in printed and "| 40,000 |" in printed
    assert "Published scenarios" not in printed  # a 0.1-year MTBI is not the published setting
    assert "70B" in printed and "at 2 Gbit/s" in printed

    table = rows(out / "goodput.csv")
    assert len(table) == 2 * len(Policy)
    assert {r["policy"] for r in table} == {p.value for p in Policy}
    for r in table:
        assert 0 < float(r["goodput"]) <= float(r["uptime"]) <= 1
        assert r["runs"] == "2"

    assert (out / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for heading in ("## Goodput (%) against fleet size", "## Uptime (%)", "## Bandwidth between sites", "goodput.png"):
        assert heading in report
    assert "docs/simulator.md" in report


def test_saved_trace_drives_the_same_numbers(tmp_path):
    # Sample once and save the failures of the largest fleet; replaying that file gives the same goodput.
    sampled, replayed = tmp_path / "sampled", tmp_path / "replayed"
    trace = tmp_path / "trace.json"
    common = [
        "--chips",
        "40000",
        "--islands",
        "4",
        "--horizon-hours",
        "2",
        "--mtbi-years",
        "0.1",
        "--jobs",
        "1",
        "--no-progress",
    ]
    assert main(["simulate", *common, "--seeds", "1", "--out", str(sampled), "--save-trace", str(trace)]) == 0
    events = load_trace(trace)
    assert len(events) > 50 and all(e.kind == "chip" and e.index < 40_000 for e in events)
    assert main(["simulate", *common, "--trace", str(trace), "--out", str(replayed)]) == 0
    assert main(["simulate", *common, "--trace", str(trace), "--out", str(tmp_path / "again")]) == 0
    first, second = rows(sampled / "goodput.csv"), rows(replayed / "goodput.csv")
    assert [(r["policy"], r["goodput"], r["uptime"]) for r in first] == [
        (r["policy"], r["goodput"], r["uptime"]) for r in second
    ]
    assert rows(tmp_path / "again" / "goodput.csv") == second
    assert f"trace {trace}" in (replayed / "report.md").read_text()


def test_default_grid_compares_with_the_published_figures(tmp_path, capsys):
    out = tmp_path / "sim"
    args = [
        "simulate",
        "--chips",
        "1200000",
        "--islands",
        "8",
        "--horizon-hours",
        "2",
        "--seeds",
        "1",
        "--policies",
        "dp,decoupled-diloco",
        "--jobs",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Published scenarios" in printed
    assert "| 1.2M chips, M=8 | data-parallel (non-elastic) | 27 |" in printed
    assert "| 1.2M chips, M=8 | Decoupled DiLoCo M=8 | 88 |" in printed
    assert "elastic data-parallel" not in printed.split("Bandwidth")[0]


def test_processes_give_the_same_points_as_one():
    base = SimConfig(mtbi_years=0.1, horizon_hours=1, seeds=(0, 1))
    one, _ = sweep(base, [20_000, 30_000], [4, 8], jobs=1)
    two, seconds = sweep(base, [20_000, 30_000], [4, 8], jobs=2)
    assert one == two
    assert set(seconds) == {20_000, 30_000}
    # Data-parallel policies only at the first M; DiLoCo policies at every M.
    assert sorted((p.islands, p.result.policy.value) for p in one if p.chips == 20_000) == sorted(
        [(4, p.value) for p in Policy] + [(8, "sync-diloco"), (8, "decoupled-diloco")]
    )


def test_a_run_trace_replays_its_islands_as_learners(tmp_path, capsys):
    # The trace `diloco run` writes names workers of islands island-<i>; the simulator reads each as learner i,
    # and with one chip per learner the island and the learner are the same thing.
    trace = tmp_path / "trace.json"
    save_trace(trace, [FailureEvent(20.0, "worker:island-0/0", 3.0), FailureEvent(50.0, "worker:island-1/0", 3.0)])
    out = tmp_path / "sim"
    args = [
        "simulate",
        "--chips",
        "2",
        "--islands",
        "2",
        "--horizon-hours",
        str(100 / 3600),
        "--step-seconds",
        "0.5",
        "--inner-steps",
        "10",
        "--fragments",
        "2",
        "--overlap-steps",
        "2",
        "--reform-seconds",
        "4",
        "--startup-seconds",
        "5",
        "--interrupt-recovery",
        "--trace",
        str(trace),
        "--jobs",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    table = {r["policy"]: r["goodput"] for r in rows(out / "goodput.csv")}
    same = SimConfig(
        chips=2,
        islands=2,
        horizon_hours=100 / 3600,
        step_seconds=(0.5,),
        training=SIM_TRAINING.updated(inner_steps=10, fragments=2, overlap_steps=2),
        reform_seconds=4,
        startup_seconds=5,
        interrupt_recovery=True,
        trace=(FailureEvent(20.0, "chip:0", 3.0), FailureEvent(50.0, "chip:1", 3.0)),
    )
    expected = simulate(same)
    assert table == {p.policy.value: f"{p.goodput:.5f}" for p in expected.policies}
    assert all(p.runs[0].failures == 2 for p in expected.policies)
    assert "start-up 5 s; failures during a recovery start it over" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--quorum", "9", "--islands", "8"], "quorum"),
        (["--trace", "/nonexistent/trace.json"], "No such file"),
    ],
)
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, args, message):
    code = main(
        [
            "simulate",
            "--chips",
            "20000",
            "--horizon-hours",
            "1",
            "--seeds",
            "1",
            "--jobs",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path),
            *args,
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err


def test_unknown_policy_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--policies", "dp,magic"])
    assert exit_info.value.code == 2
    assert "decoupled-diloco" in capsys.readouterr().err
