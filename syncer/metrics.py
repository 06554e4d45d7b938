"""Prometheus metrics of a shard, on a registry of its own so several shards can live in one process."""

from __future__ import annotations

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


def _total(counter: Counter) -> float:
    """A counter's value, as a scrape reads it."""
    return next(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))


class SyncerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.merges = Counter("diloco_syncer_merges", "Merges applied, per fragment", ["fragment"], registry=r)
        self.version = Gauge("diloco_syncer_fragment_version", "Current version per fragment", ["fragment"], registry=r)
        self.contributors = Histogram(
            "diloco_syncer_merge_contributors", "Islands merged per merge", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.merge_seconds = Histogram(
            "diloco_syncer_merge_seconds", "Time to merge and apply the outer step", registry=r
        )
        self.bytes_in = Counter("diloco_syncer_received_bytes", "Tensor bytes received in pushes and seeds", registry=r)
        self.bytes_out = Counter("diloco_syncer_sent_bytes", "Tensor bytes sent in pulls", registry=r)
        self.pulls = Counter(
            "diloco_syncer_pulls",
            "Pulls answered with values: in full, or as the difference to what the island held",
            ["form"],
            registry=r,
        )
        self.pushes = Counter("diloco_syncer_pushes", "Pushes taken (duplicates included)", ["result"], registry=r)
        self.staleness = Histogram(
            "diloco_syncer_push_staleness",
            "Versions between a delta's base and current",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )
        self.rejected = Counter("diloco_syncer_rejected_pushes", "Calls refused, by reason", ["reason"], registry=r)
        self.outliers = Counter(
            "diloco_syncer_outlier_contributions",
            "Contributions left out of a merge: their delta's norm beyond 8x the lower median of their peers'",
            registry=r,
        )
        self.tls_handshakes = Counter(
            "diloco_syncer_tls_handshakes",
            "TLS handshakes begun on the shard's port: one per connection, refused ones included",
            registry=r,
        )
        self.tls_connections_with_calls = Counter(
            "diloco_syncer_tls_connections_with_calls",
            "Connections to the shard's TLS port that carried a call to one of its methods (any outcome)",
            registry=r,
        )
        Gauge(
            "diloco_syncer_tls_connections_without_calls",
            "Connections to the shard's TLS port that carried no call to one of its methods: refused in the TLS "
            "handshake (a client that does not trust the job's CA, one with a certificate of another CA, or one "
            "speaking plaintext; gRPC does not tell which), still handshaking, or closed before a call",
            registry=r,
        ).set_function(lambda: _total(self.tls_handshakes) - _total(self.tls_connections_with_calls))
        self.grace_seconds = Gauge(
            "diloco_syncer_grace_seconds",
            "How long a merge now waits for more islands once its quorum is in when no push in it said its slack "
            "(adaptive, at most graceSeconds or 2 s); pushes that say it bound the wait by their slack",
            registry=r,
        )
        self.live_islands = Gauge("diloco_syncer_live_islands", "Islands heard from within the timeout", registry=r)
        self.checkpoint_seconds = Histogram(
            "diloco_syncer_checkpoint_seconds", "Time to write a checkpoint", registry=r
        )
        self.checkpoint_bytes = Gauge("diloco_syncer_checkpoint_bytes", "Size of the last checkpoint", registry=r)
        self.certificate_expiry = Gauge(
            "diloco_syncer_tls_certificate_expiry_timestamp_seconds",
            "Unix time the certificate the shard serves expires (read at start, as it is served until a restart)",
            registry=r,
        )
        self.checkpoint_time = Gauge(
            "diloco_syncer_last_checkpoint_timestamp_seconds",
            "Unix time the last checkpoint was written (0: none yet); a shard with nothing new writes none",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "diloco_syncer_checkpoint_failures", "Checkpoints that could not be written (retried)", registry=r
        )

    def serving_certificate(self, pem: bytes) -> None:
        """The shard serves this certificate (PEM, its own first): its expiry, for an alert well before it."""
        self.certificate_expiry.set(x509.load_pem_x509_certificate(pem).not_valid_after_utc.timestamp())

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Exposes /metrics on its own port, apart from gRPC."""
        start_http_server(port, addr=addr, registry=self.registry)
