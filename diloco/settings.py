"""A process's settings from arguments or `DILOCO_*` environment variables, which the operator injects.

An argument wins over the environment; a missing required setting is an error that names both.
"""

from __future__ import annotations

import os
from pathlib import Path

from diloco.core.config import TrainingConfig

DEFAULT_CORPUS_BYTES = 8 * 1024 * 1024
"""How much of a data source a trainer reads unless told (the embedded corpus is cut there): a few minutes of
training on a laptop, and the same corpus for the workers and for whoever evaluates the global model."""


def env_default(name: str, default: str | None = None) -> str | None:
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
