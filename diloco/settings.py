"""A process's settings from arguments or `DILOCO_*` environment variables, which the operator injects.

An argument wins over the environment; a missing required setting is an error that names both.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import overload

from diloco.core.config import TrainingConfig
from diloco.transport import tls
from diloco.transport.auth import AcceptedTokens

DEFAULT_CORPUS_BYTES = 8 * 1024 * 1024
"""How much of a data source a trainer reads unless told (the embedded corpus is cut there): a few minutes of
training on a laptop, and the same corpus for the workers and for whoever evaluates the global model."""


@overload
def env_default(name: str, default: str) -> str: ...
@overload
def env_default(name: str, default: None = None) -> str | None: ...
def env_default(name: str, default: str | None = None) -> str | None:
    """DILOCO_`name` from the environment, else `default`."""
    return os.environ.get(f"DILOCO_{name}", default)


def load_training_config(path: str | None) -> TrainingConfig:
    """From a JSON file (camelCase, as the operator's ConfigMap holds it), DILOCO_CONFIG, or defaults."""
    path = path or env_default("CONFIG_FILE")
    if path:
        return TrainingConfig.from_json(Path(path).read_text())
    text = env_default("CONFIG")
    return TrainingConfig.from_json(text) if text else TrainingConfig()


def load_token(path: str | None) -> str:
    """The job's bearer token from a file (a mounted Secret) or DILOCO_TOKEN."""
    path = path or env_default("TOKEN_FILE")
    token = Path(path).read_text().strip() if path else (env_default("TOKEN") or "")
    if not token:
        raise ValueError("no job token: pass --token-file or set DILOCO_TOKEN / DILOCO_TOKEN_FILE")
    return token


def load_accepted_tokens(path: str | None) -> AcceptedTokens:
    """The tokens a server accepts: those in a file, one per line, re-read whenever it changes (a mounted Secret
    updated in place during a token rotation), or DILOCO_TOKEN alone."""
    path = path or env_default("TOKEN_FILE")
    try:
        return AcceptedTokens(path=Path(path)) if path else AcceptedTokens((env_default("TOKEN") or "",))
    except ValueError:
        raise ValueError("no job token: pass --token-file or set DILOCO_TOKEN / DILOCO_TOKEN_FILE") from None


def env_flag(name: str) -> bool:
    """A `DILOCO_*` switch: on when set to 1 or true."""
    return (env_default(name) or "").strip().lower() in ("1", "true")


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The TLS flags every process of a job takes, each also read from the `DILOCO_*` variable of its name."""
    parser.add_argument("--tls-ca-file", help="CA certificate that verifies the peer (else DILOCO_TLS_CA_FILE)")
    parser.add_argument(
        "--tls-cert-file",
        help="this side's certificate: a syncer's, or an island's for mutual TLS (DILOCO_TLS_CERT_FILE)",
    )
    parser.add_argument("--tls-key-file", help="the certificate's private key (else DILOCO_TLS_KEY_FILE)")
    parser.add_argument(
        "--tls-mutual",
        action="store_const",
        const=True,
        help="mutual TLS: syncers demand, islands present, a certificate of the CA (else DILOCO_TLS_MUTUAL=1)",
    )
    parser.add_argument(
        "--insecure-plaintext",
        action="store_const",
        const=True,
        help="no TLS: traffic and the token in the clear (else DILOCO_INSECURE_PLAINTEXT=1)",
    )


def load_security(role: tls.Role, args: argparse.Namespace | None = None) -> tls.Security:
    """How this process secures its channels, from `add_tls_arguments`'s flags or the DILOCO_TLS_* and
    DILOCO_INSECURE_PLAINTEXT variables the operator injects; TlsError when they do not secure `role`."""

    def given(name: str) -> str | None:
        value = getattr(args, name, None) if args is not None else None
        return value or env_default(name.upper())

    def switch(name: str) -> bool:
        value = getattr(args, name, None) if args is not None else None
        return bool(value) or env_flag(name.upper())

    return tls.load(
        role,
        ca_file=given("tls_ca_file"),
        cert_file=given("tls_cert_file"),
        key_file=given("tls_key_file"),
        mutual=switch("tls_mutual"),
        insecure_plaintext=switch("insecure_plaintext"),
    )
