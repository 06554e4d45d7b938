"""An island's inner-optimizer state on disk, so that a restarted island trains on warm.

A killed island's replacement takes the global model from the shards, but its inner optimizer's moments
live nowhere else: fresh ones make its first steps those of a cold start. So every `checkpoint_every` steps
each rank copies its optimizer's state and a background thread writes it (safetensors, one file per rank:
the ranks of a multi-node island keep theirs on their own pods' volumes), to a temporary file renamed over
the last one, so a kill mid-write leaves the previous checkpoint whole. The training thread only takes the
copy (on an accelerator, queued on a side stream: `diloco.worker.sync.HostCopy`); a write still running
when the next falls due makes that one be skipped rather than waited for.

The state is read from `optimizer.state` directly (not `state_dict()`, which imports `torch._dynamo`), per
parameter in the order of the optimizer's parameter groups, so any optimizer whose state is tensors per
parameter (AdamW's step, exp_avg, exp_avg_sq) is saved and restored as it is.

With the sparse encoding the same file holds the island's error-feedback buffers (rank 0's: the rank that
pushes), named `feedback.<fragment>.<position>`, so what the island held back survives its restart
(`diloco.worker.error_feedback`); the optimizer's restore passes over them.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from diloco.worker.error_feedback import ErrorFeedback
from diloco.worker.sync import HostCopy

log = logging.getLogger("diloco.worker")

_STEP_KEY = "step"
_FORMAT = "diloco-island-optimizer/1"
_FEEDBACK = "feedback."


def checkpoint_path(folder: Path, island: str, rank: int) -> Path:
    """Where `rank` of `island` keeps its optimizer state within `folder`."""
    return folder / f"{island}-rank{rank}.safetensors"


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state, named `<parameter index>.<key>` (the live tensors, not copies)."""
    return {
        f"{index}.{key}": value
        for index, param in enumerate(_parameters(optimizer))
        for key, value in optimizer.state.get(param, {}).items()
        if isinstance(value, torch.Tensor)
    }


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, torch.Tensor]) -> bool:
    """Puts `saved` into the optimizer's state, as torch's own `load_state_dict` places each value (AdamW's
    step stays on the CPU, moments go to their parameter's device and dtype). False, with the state left
    as it was, when `saved` does not fit the optimizer's parameters (another model, or a partial file)."""
    params = _parameters(optimizer)
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for name, value in saved.items():
        if name.startswith(_FEEDBACK):
            continue
        index, _, key = name.partition(".")
        if not index.isdigit() or int(index) >= len(params):
            return False
        param = params[int(index)]
        if key != _STEP_KEY and value.shape != param.shape:
            return False
        state.setdefault(param, {})[key] = value
    if len(state) != len(params):
        return False
    for group in optimizer.param_groups:
        steps_on_device = group.get("capturable", False) or group.get("fused", False)
        for param in group["params"]:
            optimizer.state[param] = {
                key: _placed(key, value, param, steps_on_device) for key, value in state[param].items()
            }
    return True


def _placed(key: str, value: torch.Tensor, param: torch.Tensor, steps_on_device: bool) -> torch.Tensor:
    if key != _STEP_KEY:
        return value.to(param.device, param.dtype)
    return value.to(param.device) if steps_on_device else value


def load(path: Path, optimizer: torch.optim.Optimizer) -> int | None:
    """The step of the checkpoint at `path` once its state is in `optimizer`; None when there is none
    usable (missing, unreadable, or of another model), the optimizer then untouched."""
    read = _read(path, lambda name: not name.startswith(_FEEDBACK))
    if read is None:
        return None
    step, saved = read
    if step is None or not restore_optimizer(optimizer, saved):
        log.warning("island checkpoint does not fit this optimizer", extra={"path": str(path)})
        return None
    return step


def load_error_feedback(path: Path) -> dict[str, torch.Tensor]:
    """The error-feedback buffers saved in the checkpoint at `path`, named as `ErrorFeedback.named` names
    them, for `ErrorFeedback.restore`; none when there is no usable checkpoint or it holds none."""
    read = _read(path, lambda name: name.startswith(_FEEDBACK))
    if read is None or read[0] is None:
        return {}
    return {name.removeprefix(_FEEDBACK): value for name, value in read[1].items()}


def _read(path: Path, wanted: Callable[[str], bool]) -> tuple[int | None, dict[str, torch.Tensor]] | None:
    """The step (None when the file is not an island checkpoint) and the `wanted` tensors of the file at
    `path`; None when there is no file or it cannot be read."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as reader:
            metadata = reader.metadata() or {}
            saved = {name: reader.get_tensor(name) for name in reader.keys() if wanted(name)}
    except (OSError, SafetensorError) as error:
        log.warning("island checkpoint unreadable", extra={"path": str(path), "error": str(error)})
        return None
    return (int(metadata["step"]) if metadata.get("format") == _FORMAT else None), saved


class IslandCheckpointer:
    """Writes one rank's optimizer state, and its error-feedback buffers if it has any, every so often, off
    the training thread."""

    def __init__(self, path: Path, optimizer: torch.optim.Optimizer, feedback: ErrorFeedback | None = None) -> None:
        self.path = path
        self.optimizer = optimizer
        self.feedback = feedback
        self._writer: threading.Thread | None = None
        self.saved_step: int | None = None

    def save(self, step: int) -> bool:
        """Copies the state as it is after `step` and starts writing it; False (nothing done) while the
        previous write is still running."""
        if self._writer is not None and self._writer.is_alive():
            return False
        named = optimizer_tensors(self.optimizer)
        if not named:
            return False
        copy = HostCopy(list(named.values()))
        held = self.feedback.named() if self.feedback is not None else {}
        feedback = {_FEEDBACK + name: value for name, value in held.items()}
        self._writer = threading.Thread(
            target=self._write, args=(list(named), copy, feedback, step), name="diloco-island-checkpoint", daemon=True
        )
        self._writer.start()
        return True

    def _write(self, names: list[str], copy: HostCopy, feedback: dict[str, torch.Tensor], step: int) -> None:
        try:
            write_atomically(self.path, dict(zip(names, copy.values())) | feedback, step)
            self.saved_step = step
        except OSError:
            log.exception("island checkpoint not written", extra={"path": str(self.path), "step": step})

    def close(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for a write in progress."""
        if self._writer is not None:
            self._writer.join(timeout)


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], step: int) -> None:
    """Writes to a temporary file beside `path`, fsyncs it and renames it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": _FORMAT, "step": str(step)})
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
