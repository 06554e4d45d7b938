"""The gpu tier: the built-in trainer and `diloco run` on a CUDA device, in bf16 over fp32 master weights.
Skipped, never failed, without CUDA (tests/conftest.py); run on a GPU machine with `pytest -m gpu -s`, which
also prints what each test measured."""

from __future__ import annotations

import json

import pytest
import torch

from diloco.cli import main as diloco_main
from diloco.core.config import Mode, Precision, TrainingConfig
from diloco.transport.tls import PLAINTEXT
from diloco.worker.sync import HostCopy
from diloco.worker.trainer import Trainer, TrainerSettings

pytestmark = pytest.mark.gpu


def test_the_trainer_learns_on_cuda_in_bf16_over_fp32_master_weights(tmp_path):
    settings = TrainerSettings(
        mode=Mode.DDP.value, model="small", batch_size=8, steps=60, eval_every=1000, device="cuda"
    )
    trainer = Trainer(settings, TrainingConfig(), island="gpu", syncers=[], token="", security=PLAINTEXT)
    try:
        before = trainer.evaluate()
        after = trainer.run()
    finally:
        trainer.close()
    assert trainer.precision == Precision.BF16, "auto is bf16 on an accelerator that has it"
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in trainer.model.parameters())
    assert all(state["exp_avg"].dtype == torch.float32 for state in trainer.optimizer.state.values())
    assert after < before - 0.5, (before, after)
    rate = trainer.rate
    print(f"\nsmall preset, bf16, {trainer.device_name}: {rate.tokens_per_second:.0f} tokens/s, MFU {rate.mfu}")
    assert rate.tokens_per_second > 0 and rate.mfu is not None and 0 < rate.mfu < 1


@pytest.mark.process
@pytest.mark.parametrize(("encoding", "loss_below"), [("int4", 3.5), ("sparse", 5.0)])
def test_diloco_run_trains_islands_sharing_a_gpu_and_reports_throughput(encoding, loss_below, tmp_path, capsys):
    """The sparse encoding's top-k and error feedback run on the device's tensors like int4's quantizer. In
    60 steps it sends a few percent of each delta, the rest carried over, so its loss is still high (4.76 on
    an H100, 2.93 with int4; an untrained model's is ln 256 = 5.55)."""
    args = ["--islands", "2", "--steps", "60", "--device", "cuda", "--encoding", encoding, "--out", str(tmp_path)]
    code = diloco_main(["run", "--quiet", *args])
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(printed)
    assert code == 0
    (summary,) = json.loads((tmp_path / "summary.json").read_text())
    assert summary["merges"] > 0 and summary["final_loss"] < loss_below
    assert summary["tokens_per_second"] > 0 and summary["mfu"] is not None
    assert "MFU" in printed


def test_a_snapshot_holds_its_steps_values_while_training_goes_on():
    params = [torch.randn(1024, 1024, device="cuda") for _ in range(3)]
    expected = [p.cpu() for p in params]
    copy = HostCopy(params)
    for p in params:
        p.add_(1.0)  # the next optimizer step, queued before the copy is done
    values = copy.values()
    assert all(torch.equal(v, e) for v, e in zip(values, expected))
    assert all(v.is_pinned() and v.dtype == torch.float32 for v in values)


def test_a_snapshot_of_a_gpu_models_optimizer_state_takes_the_host_step_counts_too():
    """AdamW keeps its moments beside the parameters on the GPU and its `step` counts on the host: an island
    checkpoint copies both kinds in one snapshot."""
    model = torch.nn.Linear(8, 8).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values()]
    assert {t.device.type for t in state} == {"cuda", "cpu"}
    values = HostCopy(state).values()
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in values)
    assert all(torch.equal(v, t.float().cpu()) for v, t in zip(values, state))
