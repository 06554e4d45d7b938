"""`diloco run` on examples/hf_llama: a Llama configuration, its tokenizer and JSON Lines shards. Four islands
train it while one is killed mid-epoch; the held-out loss falls, the export is Hugging Face's layout, which
transformers alone loads and evaluates as we do, and the killed island's replacement reads on where it
stopped, no window read twice in an epoch. One run (about three minutes on two busy cores) serves every test."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from support import wait_until

from diloco.cli import main
from diloco.export.model_files import load
from diloco.progress import EvalEvent, MergeEvent, StartEvent, StepEvent, read_events
from diloco.worker.data import epoch_order, island_windows, load_tokens, split_holdout
from diloco.worker.tokenizer import load_tokenizer

pytestmark = pytest.mark.process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama"
ISLANDS, STEPS, BATCH, CONTEXT = 4, 30, 8, 128
KILLED, KILL_AT = "island-1", 6  # of the about 14 steps an island's share of an epoch lasts


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """The run's folder and the pid of the process killed once it had trained KILL_AT steps."""
    out = tmp_path_factory.mktemp("llama")
    killed = {}

    def killer():
        def victim():
            steps = [e for e in read_events(out / "diloco" / "progress") if isinstance(e, StepEvent)]
            hits = [e for e in steps if e.source.island == KILLED and e.step >= KILL_AT]
            return hits[0].source.pid if hits else None

        killed["pid"] = pid = wait_until(victim, timeout=300, interval=0.1)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    args = ["run", "--model", str(EXAMPLE / "config.json"), "--tokenizer", str(EXAMPLE / "tokenizer.json")]
    args += ["--data", str(EXAMPLE / "data"), "--islands", str(ISLANDS), "--steps", str(STEPS)]
    args += ["--batch-size", str(BATCH), "--inner-steps", "10", "--eval-every", "10", "--quiet", "--out", str(out)]
    assert main(args) == 0
    thread.join(1)
    assert "pid" in killed, f"{KILLED} never reached step {KILL_AT}"
    return out, killed["pid"]


def test_four_islands_train_the_llama_and_its_held_out_loss_falls(llama_run):
    out, _ = llama_run
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["merges"] >= ISLANDS, "the killed island was replaced"
    evals = [e for e in read_events(out / "diloco" / "progress") if isinstance(e, EvalEvent)]
    first = min(e.loss for e in evals if e.step == 10)  # the islands' first measurements, after 10 steps each
    assert summary["final_loss"] < first - 0.3 < math.log(2048) - 0.3, (summary["final_loss"], first)
    merges = [e for e in read_events(out / "diloco" / "merges") if isinstance(e, MergeEvent)]
    assert sum(e.landed for e in merges) >= ISLANDS, "every island's last pushes landed"
    assert summary["final_loss"] <= summary["islands_loss"] + 0.03, "the export as good as the islands"
    exported = load(out / "diloco" / "model")
    assert exported.config["model_type"] == "llama" and exported.config["outer_steps"] >= 1
    config = json.loads((out / "diloco" / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 128


FRESH_INTERPRETER = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, batch, logits = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
with torch.no_grad():
    torch.save(model(input_ids=torch.load(batch)).logits, logits)
prompt = tokenizer("The syncer", return_tensors="pt")
out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
print(tokenizer.decode(out[0], skip_special_tokens=True))
assert not [m for m in sys.modules if m.split(".")[0] == "diloco"], "nothing of ours was imported"
"""


def test_transformers_alone_loads_the_export_computes_our_logits_and_generates(llama_run, tmp_path):
    out, _ = llama_run
    folder = out / "diloco" / "model"
    tokenizer = load_tokenizer(EXAMPLE / "tokenizer.json")
    tokens = load_tokens(str(EXAMPLE / "data"), 1 << 30, tokenizer)
    _, heldout = split_holdout(tokens)
    batch = torch.stack([heldout[i * CONTEXT : (i + 1) * CONTEXT] for i in range(4)]).long()
    torch.save(batch, tmp_path / "batch.pt")
    done = subprocess.run(
        [sys.executable, "-c", FRESH_INTERPRETER, str(folder), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    theirs = torch.load(tmp_path / "out.pt")
    ours = load(folder).language_model()
    with torch.no_grad():
        logits, _ = ours.forward(batch, None)
    assert theirs.shape == logits.shape == (4, CONTEXT, 2048)
    assert torch.allclose(theirs, logits, atol=1e-4, rtol=1e-4)
    text = done.stdout.strip()
    assert text.startswith("The syncer") and len(text) > len("The syncer"), text


def test_the_killed_islands_replacement_reads_on_where_it_stopped_and_no_window_is_read_twice(llama_run):
    out, killed_pid = llama_run
    events = read_events(out / "diloco" / "progress")
    killed_steps = [e for e in events if isinstance(e, StepEvent) and e.source.pid == killed_pid]
    (replacement,) = [
        e for e in events if isinstance(e, StartEvent) and e.source.island == KILLED and e.source.pid != killed_pid
    ]
    assert killed_steps[-1].data_to[0] == 0, "killed in its first epoch"
    assert (replacement.data_epoch, replacement.data_window) == killed_steps[-1].data_to
    assert replacement.data_window > 0

    tokenizer = load_tokenizer(EXAMPLE / "tokenizer.json")
    train, _ = split_holdout(load_tokens(str(EXAMPLE / "data"), 1 << 30, tokenizer))
    read: dict[int, list[int]] = defaultdict(list)  # epoch -> every window read in it, by any island
    for island in range(ISLANDS):
        steps = [e for e in events if isinstance(e, StepEvent) and e.source.island == f"island-{island}"]
        for step in steps:
            (epoch, start), (end_epoch, end) = step.data_from, step.data_to
            while (epoch, start) < (end_epoch, end):
                windows = island_windows(epoch_order(train.numel(), CONTEXT, 0, epoch), island, ISLANDS)
                stop = end if epoch == end_epoch else windows.size
                read[epoch] += windows[start:stop].tolist()
                epoch, start = (epoch + 1, 0) if epoch < end_epoch else (epoch, stop)
    assert set(read) >= {0, 1}, "the islands read into a second epoch"
    for epoch, windows in read.items():
        assert len(windows) == len(set(windows)), f"a window was read twice in epoch {epoch}"
