"""`diloco run` refuses a job the cluster would refuse, before it starts a process."""

import pytest

from diloco.cli import main
from diloco.local.run import modes_to_run


def test_a_quorum_above_the_islands_is_refused(tmp_path, capsys):
    args = ["run", "--islands", "2", "--quorum", "3", "--quiet", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "--quorum (K=3) must not exceed the number of islands in --islands (2)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_link_no_network_has_is_refused(tmp_path, capsys):
    args = ["run", "--islands", "2", "--link-mbps", "0", "--quiet", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "--link-mbps must be a positive number of Mbit/s" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_shaped_run_where_namespaces_cannot_be_made_is_refused_saying_why(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    args = ["run", "--islands", "2", "--link-mbps", "10", "--quiet", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "shaped links need network namespaces, which need root" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_transfer_rate_no_link_has_is_refused(tmp_path, capsys):
    args = ["run", "--islands", "2", "--min-transfer-mbps", "0", "--quiet", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "min_transfer_mbps" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_per_island_values_that_are_not_numbers_or_too_small_are_refused(tmp_path, capsys):
    for option, value, said in (
        ("--jitter", "0,x", "--jitter takes comma-separated numbers"),
        ("--jitter", "0,-1", "--jitter values must be at least 0"),
        ("--slowdown", "1,0.5", "--slowdown values must be at least 1"),
    ):
        args = ["run", "--islands", "2", option, value, "--quiet", "--out", str(tmp_path / "run")]
        assert main(args) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_outer_momentum_the_optimizer_cannot_take_is_refused(tmp_path, capsys):
    args = ["run", "--outer-momentum", "1.5", "--quiet", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "momentum" in capsys.readouterr().err


def test_ddp_with_a_command_is_refused_saying_why(tmp_path, capsys):
    args = ["run", "--mode", "ddp", "--quiet", "--out", str(tmp_path / "run"), "--", "python", "train.py"]
    assert main(args) == 2
    assert "ddp is not run for a command: data-parallel all-reduces gradients" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_equal_time_with_a_command_is_refused_since_the_command_counts_its_own_steps(tmp_path, capsys):
    args = ["run", "--equal-time", "--quiet", "--out", str(tmp_path / "run"), "--", "python", "train.py"]
    assert main(args) == 2
    assert "--equal-time sets the built-in trainer's steps" in capsys.readouterr().err


def test_compare_runs_every_mode_for_the_trainer_and_sync_diloco_beside_a_command():
    assert modes_to_run("diloco", True, ()) == ["diloco", "sync-diloco", "ddp"]
    assert modes_to_run("diloco", True, ("python", "train.py")) == ["diloco", "sync-diloco"]
    assert modes_to_run("sync-diloco", True, ("python", "train.py")) == ["sync-diloco", "diloco"]
    assert modes_to_run("diloco", False, ("python", "train.py")) == ["diloco"]


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--islands", "2", "--hostile-islands", "2"], "must leave at least one"),
        (["--hostile-islands", "-1"], "must leave at least one"),
        (["--hostile-islands", "1", "--mode", "ddp"], "ddp has no syncers"),
    ],
)
def test_hostile_islands_that_leave_no_honest_island_or_have_no_syncers_are_refused(tmp_path, capsys, extra, says):
    assert main(["run", "--out", str(tmp_path), *extra]) == 2
    assert says in capsys.readouterr().err
