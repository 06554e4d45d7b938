"""A shard accepts the tokens its file lists and reads the file again when it changes, as a Secret volume the
kubelet updates in place: a rotation adds the new token beside the old and later drops the old, with no
restart, and no client holding a token still listed is ever refused."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from support import TEST_PKI
from syncer_harness import config_for, wait_until

from diloco.syncer.server import SyncerServer
from diloco.transport.auth import AcceptedTokens, token_fingerprint
from diloco.transport.client import SyncerClient


def publish(folder: Path, text: str) -> Path:
    """Writes the Secret's `accepted` key as the kubelet does: a new timestamped folder, then `..data` swapped to
    it by a rename, the key itself a symlink through `..data`."""
    stamp = folder / f"..stamp-{len(list(folder.glob('..stamp-*')))}"
    stamp.mkdir()
    (stamp / "accepted").write_text(text)
    link = folder / "..data_tmp"
    link.symlink_to(stamp.name)
    os.replace(link, folder / "..data")
    key = folder / "accepted"
    if not key.is_symlink():
        key.symlink_to("..data/accepted")
    return key


def test_the_file_is_read_again_when_the_kubelet_swaps_it(tmp_path):
    key = publish(tmp_path, "old\n")
    tokens = AcceptedTokens(path=key, recheck=0)
    assert tokens.current() == ("old",)
    publish(tmp_path, "old\nnew\n")
    assert tokens.current() == ("old", "new")
    publish(tmp_path, "new\n")
    assert tokens.current() == ("new",)


def test_a_file_gone_or_empty_leaves_the_last_tokens_in_force(tmp_path):
    key = tmp_path / "accepted"
    key.write_text("only\n")
    tokens = AcceptedTokens(path=key, recheck=0)
    key.write_text("\n")
    assert tokens.current() == ("only",)
    key.unlink()
    assert tokens.current() == ("only",)
    with pytest.raises(ValueError, match="must not be empty"):
        AcceptedTokens(path=key)


def test_the_file_is_looked_at_no_more_than_once_per_recheck(tmp_path):
    key = tmp_path / "accepted"
    key.write_text("a\n")
    now = [0.0]
    tokens = AcceptedTokens(path=key, recheck=5.0, clock=lambda: now[0])
    key.write_text("b\n")
    now[0] = 4.0
    assert tokens.current() == ("a",)
    now[0] = 5.0
    assert tokens.current() == ("b",)


def answers(port: int, token: str) -> bool:
    """Whether the shard answers a Status call made with `token` (False: refused, UNAUTHENTICATED)."""
    with SyncerClient(f"127.0.0.1:{port}", token, security=TEST_PKI.client, timeout=5, retry_for=5) as client:
        try:
            client.status()
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            return False
    return True


@pytest.mark.process
def test_a_shard_takes_the_new_token_beside_the_old_then_drops_the_old_without_a_restart(tmp_path):
    key = publish(tmp_path, "old\n")
    server = SyncerServer(
        config_for(),
        shard_index=0,
        num_shards=1,
        token=AcceptedTokens(path=key, recheck=0.1),
        security=TEST_PKI.server,
    )
    server.start()
    try:
        assert answers(server.port, "old") and not answers(server.port, "new")
        publish(tmp_path, "old\nnew\n")
        wait_until(lambda: answers(server.port, "new"), timeout=10)
        assert answers(server.port, "old"), "both while the islands roll"
        with SyncerClient(f"127.0.0.1:{server.port}", "old", security=TEST_PKI.client, timeout=5) as client:
            assert list(client.status().accepted_tokens) == [token_fingerprint("old"), token_fingerprint("new")]
        publish(tmp_path, "new\n")
        wait_until(lambda: not answers(server.port, "old"), timeout=10)
        assert answers(server.port, "new")
    finally:
        server.stop(grace=0)
