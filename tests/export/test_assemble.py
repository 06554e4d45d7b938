"""The global model out of a job: assembled from live shards over gRPC and from their checkpoint files, it is
what the shards hold, tensor for tensor, and loads into the built-in GPT."""

import pytest
import torch
from support import TEST_PKI, tls_env

from diloco.cli import main
from diloco.core.config import TrainingConfig
from diloco.export.assemble import from_checkpoints, from_shards
from diloco.export.model_files import load, save
from diloco.syncer.server import SyncerServer
from diloco.transport.client import Backoff
from diloco.worker.learner import Learner
from diloco.worker.model import build_model

pytestmark = pytest.mark.process

TOKEN = "export-test-token"
CONFIG = TrainingConfig(inner_steps=8, fragments=4, overlap_steps=1, grace_seconds=0.0, quorum=1, encoding="fp32")


@pytest.fixture
def trained_shards(tmp_path):
    """Two shards with checkpoints, after one island trained the tiny GPT for a few outer steps."""
    servers = [
        SyncerServer(
            CONFIG,
            shard_index=i,
            num_shards=2,
            token=TOKEN,
            security=TEST_PKI.server,
            port=0,
            checkpoint_dir=tmp_path / "ckpt",
        )
        for i in range(2)
    ]
    for server in servers:
        server.start()
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    model = build_model("tiny", 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    learner = Learner(
        model,
        optimizer,
        CONFIG,
        syncers=targets,
        token=TOKEN,
        security=TEST_PKI.client,
        island_id="a",
        backoff=Backoff(0.02, 0.2),
    )
    learner.start()
    tokens = torch.Generator().manual_seed(0)
    for _ in range(10):
        batch = torch.randint(0, 256, (2, 33), generator=tokens)
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        learner.report(tokens=64)
        optimizer.step()
        optimizer.zero_grad()
    learner.flush(30)
    learner.close()
    yield servers, targets, tmp_path / "ckpt"
    for server in servers:
        server.stop(grace=0)


def export_cli(out, *source):
    """`diloco export OUT SOURCE...` with the job's token; True when it succeeded."""
    token_file = out.parent / "token"
    token_file.write_text(TOKEN)
    tls = tls_env(out.parent / "tls", server=False)
    flags = ["--tls-ca-file", tls["DILOCO_TLS_CA_FILE"]]
    return main(["export", str(out), *source, "--token-file", str(token_file), *flags]) == 0


def held(servers):
    """Every tensor as the shards' own state holds it."""
    return {
        spec.name: value
        for server in servers
        for fragment in server.state.fragments.values()
        for spec, value in zip(fragment.specs, fragment.values)
    }


def test_live_and_checkpoint_exports_are_what_the_shards_hold(trained_shards, tmp_path):
    servers, targets, checkpoints = trained_shards
    live = from_shards(targets, TOKEN, security=TEST_PKI.client)
    holding = held(servers)
    assert live.outer_steps >= 1 and live.tokens > 0
    assert live.tensors.keys() == holding.keys()
    assert all(torch.equal(live.tensors[name], holding[name]) for name in holding)
    assert export_cli(tmp_path / "model", "--syncers", ",".join(targets))
    exported = load(tmp_path / "model")
    assert all(torch.equal(exported.tensors[name], holding[name]) for name in holding)
    for server in servers:
        server.stop()  # a graceful stop writes the final checkpoint
    saved = from_checkpoints([checkpoints])
    assert saved.fragments == live.fragments
    assert all(torch.equal(saved.tensors[name], holding[name]) for name in holding)
    save(tmp_path / "saved", saved, training=CONFIG)
    reread = load(tmp_path / "saved").tensors
    assert all(torch.equal(reread[name], holding[name]) for name in holding)


def test_an_export_needs_every_shard(trained_shards):
    servers, targets, checkpoints = trained_shards
    with pytest.raises(ValueError, match="every shard"):
        from_shards(targets[:1], TOKEN, security=TEST_PKI.client)
    servers[0].stop()
    with pytest.raises(ValueError, match="every shard"):
        from_checkpoints(sorted(checkpoints.glob("shard-0-*")))
