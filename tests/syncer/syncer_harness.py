"""Helpers shared by the syncer's process-level tests (conftest re-exports the old ones). A module of its own,
with a unique name, so test modules can import it while other test folders have their own conftest."""

from __future__ import annotations

import socket
from typing import TypeVar

import grpc
import torch
from support import (
    TEST_PKI,
    wait_until,  # noqa: F401  (re-exported to the syncer tests)
)

from diloco.core.config import TrainingConfig
from diloco.transport import tls, wire
from diloco.transport.client import Backoff, SyncerClient

TOKEN = "test-token"
SHAPES = {"w": (64, 32), "b": (32,)}
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fragment_values(fill: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.full(shape, fill)) for name, shape in SHAPES.items()]


def framed(chunk_type: type[T], data: bytes, offset: int = 0) -> T:
    """A data message of `chunk_type` (PushChunk or FragmentChunk) carrying `data` at byte `offset` of its
    stream, placed and checksummed as a well-behaved peer sends it."""
    return chunk_type.FromString(wire.data_message([data], offset))


def make_client(port: int, island: str = "", **kwargs) -> SyncerClient:
    kwargs.setdefault("backoff", Backoff(initial=0.02, maximum=0.5))
    kwargs.setdefault("security", TEST_PKI.client)
    return SyncerClient(f"127.0.0.1:{port}", TOKEN, island_id=island, **kwargs)


def open_channel(port: int, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A raw channel to a shard on loopback over TLS with the tests' CA, for calls the client never makes."""
    return tls.channel(f"127.0.0.1:{port}", TEST_PKI.client, options or [])


def versions(client: SyncerClient) -> dict[int, tuple[int, int]]:
    """(incarnation, version) per fragment, from the shard's Status."""
    return {f.fragment_id: (f.version.incarnation, f.version.version) for f in client.status().fragments}


def config_for(**overrides) -> TrainingConfig:
    """A small valid config: two fragments and scale blocks of 32 unless told otherwise."""
    overrides.setdefault("fragments", 2)
    overrides.setdefault("inner_steps", 10)
    overrides.setdefault("overlap_steps", 1)
    overrides.setdefault("block_size", 32)
    return TrainingConfig(**overrides)


def random_values(seed: int, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=generator) * scale) for name, shape in SHAPES.items()]


class ReferenceFragment:
    """The outer optimizer written out by hand, independent of the code under test: within a round of shares,
    the fragment sits at θ_0 − lr·G, where θ_0 is where the round opened and G is the sum of share × g over the
    round's merges (g the token-weighted mean of a merge's deltas, share = k of the `live` islands); once the
    shares make a whole round, it takes the look-ahead too, θ_0 − lr·(μ²·buf_0 + (1+μ)·G), buf ← μ·buf_0 + G,
    and the next round opens there. With whole rounds it is Nesterov SGD: buf ← μ·buf + g, θ ← θ − lr·(g +
    μ·buf)."""

    def __init__(self, config: TrainingConfig, values: list[tuple[str, torch.Tensor]]) -> None:
        self.lr = config.outer.lr
        self.mu = config.outer.momentum
        self.opened = [v.clone().double() for _, v in values]  # θ_0
        self.buf = [torch.zeros_like(t) for t in self.opened]  # buf_0
        self.grad = [torch.zeros_like(t) for t in self.opened]  # G
        self.progress = 0.0
        self.theta = [t.clone() for t in self.opened]

    def merge(self, contributions: list[tuple[list[tuple[str, torch.Tensor]], int]], live: int | None = None) -> None:
        total = sum(tokens for _, tokens in contributions)
        share = len(contributions) / (live or len(contributions))
        g = [
            sum(delta[j][1].double() * tokens for delta, tokens in contributions) / total for j in range(len(self.buf))
        ]
        while share > 1e-12:
            taken = min(share, 1 - self.progress)
            self.grad = [acc + taken * gj for acc, gj in zip(self.grad, g)]
            self.progress += taken
            share -= taken
            mu, lr = self.mu, self.lr
            self.theta = [t0 - lr * acc for t0, acc in zip(self.opened, self.grad)]
            if self.progress >= 1 - 1e-9:
                self.theta = [
                    t0 - lr * (mu * mu * b + (1 + mu) * acc) for t0, b, acc in zip(self.opened, self.buf, self.grad)
                ]
                self.buf = [mu * b + acc for b, acc in zip(self.buf, self.grad)]
                self.opened = [t.clone() for t in self.theta]
                self.grad = [torch.zeros_like(t) for t in self.theta]
                self.progress = 0.0

    def assert_matches(self, pulled: list[tuple[str, torch.Tensor]], atol: float = 1e-5) -> None:
        assert [name for name, _ in pulled] == list(SHAPES)
        for (name, got), want in zip(pulled, self.theta):
            assert torch.allclose(got.double(), want, rtol=0, atol=atol), f"tensor {name} differs from the reference"
