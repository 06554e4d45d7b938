"""A job's TLS, decided without I/O: the PEM files its pods mount and from which Secrets, the variables that
point the processes at them, the certificates the operator makes when the job names no Secret, and how the
operator itself calls the shards.

With `spec.tls.serverSecret` and `caSecret` (and `clientSecret` for mutual TLS) the job brings its own PKI
and the operator only mounts it. Otherwise the operator keeps Secret `diloco-<job>-tls`: the certificate of a CA
of this job alone, a server certificate for the syncer Services' names and a client certificate, made once and
kept (certificates are not derivable like the token, so the live Secret is the record), re-issued only when the
shards' names change or a certificate nears its end. The CA's private key is in no Secret: it is derived from the
operator's key, like the token (`tokens.ca_key`), so no pod of any job can mount it, and the operator makes it
again whenever it issues a certificate. A fingerprint of what the pods hold annotates their templates, so a new
certificate rolls every syncer and island together, as a new token does.

The server certificate names the Services and, for shards exposed outside the cluster (spec.syncer.expose),
the hosts remote islands dial (`exposure.external_hosts`: a LoadBalancer's ingress address once the cloud
has published it, the NodePort's node address, the route hostnames): a new address re-issues it. A job
with its own Secrets must put those names in its certificate itself. A job training against another
cluster's shards (spec.remoteSyncers) mounts that job's CA and, for mutual TLS, the client certificate it
names, and makes nothing.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.api.job import DiLoCoJobSpec
from diloco.operator import naming as n
from diloco.pod_env import tls_variables
from diloco.transport import certificates
from diloco.transport.tls import PLAINTEXT, Security, Tls

TLS_DIR = "/var/run/secrets/diloco-tls"
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"
"""Keys of the operator-made Secret beside ca.crt, tls.crt and tls.key (the server's): the islands' client
certificate."""
CA_VALID_FOR = datetime.timedelta(days=10 * 365)
RENEW_BEFORE = datetime.timedelta(days=30)
"""A certificate this close to its end is replaced on the next pass, long before anyone is refused."""


def server_names(job: n.JobRef, shards: int, external: Sequence[str] = ()) -> list[str]:
    """Every name a client may reach a shard at: the Service, its namespaced and fully qualified forms, and
    the `external` hosts the shards are exposed at."""
    names = []
    for shard in range(shards):
        service = n.syncer_name(job.name, shard)
        base = f"{service}.{job.namespace}"
        names += [service, base, f"{base}.svc", f"{base}.svc.cluster.local"]
    return list(dict.fromkeys([*names, *external]))


def secret_bytes(secret: Mapping[str, Any] | None) -> dict[str, bytes]:
    """A Secret's data, decoded; empty for a missing Secret."""
    return {key: base64.b64decode(value) for key, value in ((secret or {}).get("data") or {}).items()}


def _lasts(cert: bytes, now: datetime.datetime) -> bool:
    """Whether a certificate is readable and valid for more than RENEW_BEFORE yet."""
    try:
        return certificates.expires(cert) - now > RENEW_BEFORE
    except ValueError:
        return False


def _usable(data: Mapping[str, bytes], cert_key: str, key_key: str, now: datetime.datetime) -> bool:
    cert = data.get(cert_key)
    return cert is not None and key_key in data and certificates.signed_by(cert, data[CA_FILE]) and _lasts(cert, now)


def operator_made_data(
    job: n.JobRef, live: Mapping[str, bytes], names: list[str], now: datetime.datetime, ca_key: bytes
) -> dict[str, bytes]:
    """The contents of Secret `diloco-<job>-tls`: what `live` holds where it is still good (the CA certificate
    for `ca_key`, the job's derived CA key, valid for more than RENEW_BEFORE; certificates signed by it, not near
    their end, the server's for exactly `names`), newly made where not. A new CA re-issues both certificates.
    Whatever else `live` holds is dropped (the CA key that versions before this one kept there among it)."""
    data = {key: value for key, value in live.items() if key in (CA_FILE, CERT_FILE, KEY_FILE, CLIENT_CERT, CLIENT_KEY)}
    if not (CA_FILE in data and certificates.holds_key(data[CA_FILE], ca_key) and _lasts(data[CA_FILE], now)):
        ca = certificates.new_ca(f"diloco CA of {job.namespace}/{job.name}", now, valid_for=CA_VALID_FOR, key=ca_key)
        data = {CA_FILE: ca.cert}
    ca = certificates.Issued(data[CA_FILE], ca_key)
    server_good = _usable(data, CERT_FILE, KEY_FILE, now) and certificates.names_of(data[CERT_FILE]) == set(names)
    if not server_good:
        issued = certificates.issue(ca, names[0], now, names=names, server=True)
        data[CERT_FILE], data[KEY_FILE] = issued.cert, issued.key
    if not _usable(data, CLIENT_CERT, CLIENT_KEY, now):
        issued = certificates.issue(ca, "diloco island", now, server=False)
        data[CLIENT_CERT], data[CLIENT_KEY] = issued.cert, issued.key
    return data


def islands_present_certificate(spec: DiLoCoJobSpec) -> bool:
    """Mutual TLS: the job's own (spec.tls.mutual), or the remote shards' (spec.remoteSyncers.clientSecret)."""
    remote = spec.remote_syncers
    return remote.client_secret is not None if remote is not None else spec.tls.mutual


@dataclass(frozen=True)
class JobTls:
    """What a pass renders and probes with. `made`: the operator-made Secret's data (None when the job names
    its Secrets or asked for plaintext); `held`: the PEM contents the pods mount, by Secret, for the
    fingerprint; `probe`: how the operator calls the shards, or why it cannot (a named Secret missing)."""

    spec: DiLoCoJobSpec
    made: dict[str, bytes] | None
    held: dict[str, dict[str, bytes]]
    probe: Security | str

    @property
    def mutual(self) -> bool:
        return islands_present_certificate(self.spec)

    def fingerprint(self, job: n.JobRef, syncer: bool) -> str:
        """Names the certificates and keys a syncer's (or an island's) pods mount, so new ones roll those
        pods; "" in plaintext."""
        if self.spec.tls.insecure_plaintext:
            return ""
        digest = hashlib.sha256(b"diloco tls fingerprint\0")
        for source in self._sources(job, syncer):
            secret = source["secret"]["name"]
            for item in source["secret"]["items"]:
                value = self.held.get(secret, {}).get(item["key"], b"")
                digest.update(f"{secret}\0{item['key']}\0".encode() + value + b"\0")
        return digest.hexdigest()[:16]

    def _sources(self, job: n.JobRef, syncer: bool) -> list[dict[str, Any]]:
        """The projected volume's sources: the CA, and this side's certificate and key."""
        tls = self.spec.tls
        mutual_island = self.mutual and not syncer

        def items(secret: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
            return {"secret": {"name": secret, "items": [{"key": key, "path": path} for key, path in pairs]}}

        remote = self.spec.remote_syncers
        if remote is not None:
            sources = [items(remote.ca_secret, [(CA_FILE, CA_FILE)])]
            if remote.client_secret is not None:
                sources.append(items(remote.client_secret, [(CERT_FILE, CERT_FILE), (KEY_FILE, KEY_FILE)]))
            return sources
        if tls.server_secret is not None and tls.ca_secret is not None:
            sources = [items(tls.ca_secret, [(CA_FILE, CA_FILE)])]
            if syncer:
                sources.append(items(tls.server_secret, [(CERT_FILE, CERT_FILE), (KEY_FILE, KEY_FILE)]))
            elif mutual_island and tls.client_secret is not None:
                sources.append(items(tls.client_secret, [(CERT_FILE, CERT_FILE), (KEY_FILE, KEY_FILE)]))
            return sources
        pairs = [(CA_FILE, CA_FILE)]
        if syncer:
            pairs += [(CERT_FILE, CERT_FILE), (KEY_FILE, KEY_FILE)]
        elif mutual_island:
            pairs += [(CLIENT_CERT, CERT_FILE), (CLIENT_KEY, KEY_FILE)]
        return [items(n.tls_secret_name(job.name), pairs)]

    def volumes(self, job: n.JobRef, syncer: bool) -> list[dict[str, Any]]:
        if self.spec.tls.insecure_plaintext:
            return []
        return [{"name": "tls", "projected": {"sources": self._sources(job, syncer), "defaultMode": 0o440}}]

    def mounts(self) -> list[dict[str, Any]]:
        return [] if self.spec.tls.insecure_plaintext else [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]

    def env(self, syncer: bool) -> dict[str, str]:
        """The DILOCO_TLS_* variables (`diloco.settings.load_security`) of a syncer's or an island's container."""
        if self.spec.tls.insecure_plaintext:
            return tls_variables(insecure_plaintext=True)
        own = syncer or self.mutual
        return tls_variables(
            ca_file=f"{TLS_DIR}/{CA_FILE}",
            cert_file=f"{TLS_DIR}/{CERT_FILE}" if own else None,
            key_file=f"{TLS_DIR}/{KEY_FILE}" if own else None,
            mutual=self.mutual,
        )


def job_tls(
    job: n.JobRef,
    spec: DiLoCoJobSpec,
    live_made: Mapping[str, Any] | None,
    named: Mapping[str, Mapping[str, Any] | None],
    now: datetime.datetime,
    external: Sequence[str] = (),
    *,
    ca_key: bytes,
) -> JobTls:
    """The job's TLS this pass, from the live operator-made Secret (`live_made`) or the Secrets the job names
    (`named`, by name: None for one that does not exist); `external`: the hosts its exposed shards are
    reached at, which the operator-made server certificate names too; `ca_key`: the job's CA key
    (`tokens.ca_key`), used only when the operator makes the job's certificates."""
    tls = spec.tls
    if tls.insecure_plaintext:
        return JobTls(spec, None, {}, PLAINTEXT)
    if tls.operator_made and spec.remote_syncers is None:
        names = server_names(job, spec.syncer.shards, external)
        made = operator_made_data(job, secret_bytes(live_made), names, now, ca_key)
        client = (made[CLIENT_CERT], made[CLIENT_KEY]) if tls.mutual else (None, None)
        probe = Tls(ca=made[CA_FILE], cert=client[0], key=client[1], mutual=tls.mutual)
        return JobTls(spec, made, {n.tls_secret_name(job.name): made}, probe)
    remote = spec.remote_syncers
    ca_secret, client_secret = (
        (remote.ca_secret, remote.client_secret) if remote else (tls.ca_secret, tls.client_secret)
    )
    held = {name: secret_bytes(named.get(name)) for name in spec.tls_secrets}
    missing = [name for name in spec.tls_secrets if named.get(name) is None]
    ca = held.get(ca_secret, {}).get(CA_FILE) if ca_secret else None
    client = held.get(client_secret, {}) if client_secret else {}
    mutual = islands_present_certificate(spec)
    if missing or ca is None or (mutual and not {CERT_FILE, KEY_FILE} <= client.keys()):
        why = f"Secret {', '.join(missing)} not found" if missing else "a named Secret lacks ca.crt, tls.crt or tls.key"
        return JobTls(spec, None, held, why)
    return JobTls(spec, None, held, Tls(ca=ca, cert=client.get(CERT_FILE), key=client.get(KEY_FILE), mutual=mutual))
