"""The quality gate: the model decoupled DiLoCo exports is as good as synchronous DiLoCo's on the same tokens,
however the islands' pushes happen to fall in time. Runs `diloco run` as the README's first command does (4
islands of the tiny preset, 200 steps), quiet and with one island's steps jittered; the synchronous baseline's
model does not depend on timing (a barrier), so one run of it serves both.

The full figures, over seeds, are `make bench-loss`'s (docs/training-benchmarks.md); this is the cheap check
that fails when the exported model regresses. Before the merge kept rounds of shares (momentum once per
round) and islands in phase, the same quiet run ended 1.045 to 1.20 x sync-diloco.
"""

import json

import pytest

from diloco.cli import main

pytestmark = [pytest.mark.process, pytest.mark.timeout(1200)]

TOLERANCE = 1.03
"""The exported model's held-out loss over sync-diloco's, quiet. One seed's run moves with the machine's load
and timing: 0.9973 to 1.0011 over three seeds at loads 3 to 3.9 once the islands' slack bounded a merge's wait
(2026-11-29); 1.005 to 1.013 with a 2 s cap on it, and 1.027 once in a full `make test` of that code;
1.002 to 1.017 at loads 4 to 19 before merge windows were bounded by the islands' round (2026-11-28); 1.045 to
1.20 at 3610371, before rounds of shares and islands in phase. The target, 1.01 over the mean of three seeds,
is `make bench-loss`'s."""
JITTERED_TOLERANCE = 1.03
"""The same with one island jittered: 0.986 to 0.993 with windows bounded by slack; 0.990 to 1.000 with a 2 s
cap, since islands that finished count for the slowest island's last rounds (2026-11-29); 1.016 to 1.028
without that, 1.023 to 1.067 before the round-long window."""
GLOBAL_OVER_LOCAL = 0.01
"""How much worse than the islands' own final models (their mean) the global one may be, quiet, in nats per
byte: merging the islands' last pushes must lose nothing they learned (-0.029 to +0.008 measured; 0.09 to 0.5
at 3610371)."""
JITTERED_GLOBAL_OVER_LOCAL = 0.01
"""With one island jittered the global model ends below the islands' own (-0.049 to -0.043 measured), held to
the quiet bound. It ended 0.014 to 0.035 above them while the slowest island's last rounds, merged alone after
the others had finished, counted as whole rounds."""
QUIET_ISLANDS_PER_MERGE = 3.6
"""Of 4 islands of equal speed: 3.96 to 4.00 at loads 3 to 3.9 since a merge waits for every live island within
the slack of those in it (2026-11-29); 3.64 to 3.83 when the adaptive window under a 30 s cap bounded that wait,
2.68 to 2.85 under a 2 s cap, and 1.84 to 2.04 while windows closed within 0.8 of tau steps: the floor fails
them all. The bench's target is 3.8 (docs/training-benchmarks.md)."""
JITTERED_ISLANDS_PER_MERGE = 3.0
"""With one island's steps up to 60% longer at random it misses more merges, and its last rounds, after the
others finished, merge alone: 3.32 to 3.38 measured; 3.10 to 3.23 with the adaptive window, 2.24 to 2.59 with
a 2 s cap on windows, 1.62 to 1.87 while they closed within tau steps."""
JITTER = "0,0,0,0.3"


def diloco_run(out, *options: str) -> dict:
    assert main(["run", "--quiet", "--out", str(out), *options]) == 0
    (summary,) = json.loads((out / "summary.json").read_text())
    return summary


@pytest.fixture(scope="module")
def sync_diloco(tmp_path_factory) -> dict:
    return diloco_run(tmp_path_factory.mktemp("quality") / "sync", "--mode", "sync-diloco")


def check(ours: dict, sync: dict, tolerance: float, over_local: float, islands_per_merge: float) -> None:
    ratio = ours["final_loss"] / sync["final_loss"]
    gap = ours["final_loss"] - ours["islands_loss"]
    figures = (
        f"diloco {ours['final_loss']:.4f}, sync-diloco {sync['final_loss']:.4f}, ratio {ratio:.4f}; islands' own "
        f"{ours['islands_loss']:.4f}; islands per merge {ours['islands_per_merge']:.2f}"
    )
    print(figures)
    assert ours["tokens_trained"] == sync["tokens_trained"], "the same tokens"
    assert ratio <= tolerance, figures
    assert gap <= over_local, figures
    assert ours["islands_per_merge"] >= islands_per_merge, figures


def test_the_exported_model_is_as_good_as_sync_diloco_s(sync_diloco, tmp_path):
    check(diloco_run(tmp_path / "quiet"), sync_diloco, TOLERANCE, GLOBAL_OVER_LOCAL, QUIET_ISLANDS_PER_MERGE)


def test_so_it_is_with_one_island_jittered(sync_diloco, tmp_path):
    jittered = diloco_run(tmp_path / "jitter", "--jitter", JITTER)
    check(jittered, sync_diloco, JITTERED_TOLERANCE, JITTERED_GLOBAL_OVER_LOCAL, JITTERED_ISLANDS_PER_MERGE)
