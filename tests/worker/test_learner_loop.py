"""A loop of the user's own against a real shard: the learner hooks `optimizer.step()`, so gradient
accumulation, a GradScaler and an LR scheduler work unchanged, and the loop's metrics and readiness are
served without a line of code of its own."""

from __future__ import annotations

import math
import os
import signal
import urllib.error
import urllib.request

import pytest
import torch
from learner_harness import BATCH, make_config
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from diloco.local.launcher import free_port
from diloco.operator.probes import trainer_report
from diloco.worker.shutdown import StopRequest

pytestmark = pytest.mark.process


def backward(made, scale: float = 1.0) -> None:
    x = torch.randn(BATCH, 8, generator=made.data)
    (nn.functional.mse_loss(made.model(x), x @ made.teacher) * scale).backward()


def test_an_inner_step_is_an_optimizer_step_whatever_the_micro_batches(start_shards, island):
    shards = start_shards(make_config())
    made = island(shards, seed=1, name="island-a")
    for _ in range(8):
        for _ in range(4):  # gradient accumulation: four backward passes, one optimizer step
            backward(made, scale=0.25)
            made.learner.report(tokens=BATCH)
        made.optimizer.step()
        made.optimizer.zero_grad()
        assert made.learner.wait_for_syncs(30.0)
    stats = made.learner.stats
    assert made.learner.inner_step == 8 and stats.inner_steps == 8
    assert stats.tokens == 8 * 4 * BATCH
    assert stats.syncs_merged >= 2
    assert sum(tokens for _, _, tokens in shards.status(0).values()) > 0


def test_a_step_the_grad_scaler_skips_is_no_inner_step(start_shards, island):
    shards = start_shards(make_config())
    made = island(shards, seed=1, name="island-a")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scheduler = torch.optim.lr_scheduler.StepLR(made.optimizer, step_size=1, gamma=0.5)
    for overflow in (False, True, False):
        x = torch.randn(BATCH, 8, generator=made.data)
        scaler.scale(nn.functional.mse_loss(made.model(x), x @ made.teacher)).backward()
        if overflow:
            next(made.model.parameters()).grad[0, 0] = math.inf
        scaler.step(made.optimizer)
        scaler.update()
        made.optimizer.zero_grad()
        scheduler.step()
    assert made.learner.inner_step == 2, "the step skipped for an inf gradient is not counted"
    assert made.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8), "the user's scheduler steps alone"


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_learner_serves_the_workers_metrics_and_is_ready_once_joined_and_training(start_shards, island):
    shards = start_shards(make_config())
    port = free_port()
    made = island(shards, seed=1, name="island-a", start=False, metrics_port=port, metrics_host="127.0.0.1")
    made.learner.start()
    assert readyz(port) == 503, "joined, but no step yet"
    made.learner.report(loss=0.75)
    made.train(4)
    assert readyz(port) == 200
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert samples["diloco_worker_step"] == 4 and samples["diloco_worker_tokens_total"] == 4 * BATCH
    assert samples["diloco_worker_pushes_total"] >= 1 and samples["diloco_worker_last_sync_timestamp_seconds"] > 0
    made.learner.report(loss=0.5)
    report = trainer_report(f"http://127.0.0.1:{port}/metrics", 2.0)
    assert report is not None and report.loss == 0.5, "what the operator puts in the status"
    made.learner.close()
    with pytest.raises(urllib.error.URLError):
        readyz(port)


def test_after_a_stop_request_the_loop_ends_pushes_its_last_steps_and_leaves(start_shards, island):
    shards = start_shards(make_config(inner_steps=8))
    stop = StopRequest(grace_seconds=10.0)
    stop.install((signal.SIGTERM,))
    made = island(shards, seed=1, name="island-a", start=False, stop=stop)
    with made.learner:
        while not made.learner.stop_requested:
            made.train(1)
            if made.learner.inner_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
    assert made.learner.inner_step == 3, "no fragment was due yet: only the flush pushes these steps"
    assert made.learner.stats.syncs_merged == 2
    assert shards.live_islands(0) == []
