"""examples/hf_llama applied as its README says: its volumes, the data volume filled with the example's Llama
configuration, tokenizer and text shards, then its DiLoCoJob. Two islands train the Llama from the volume,
each reading its own share of the shards; the job succeeds at its stop condition and exports the model in
Hugging Face's layout to the user's volume, which transformers loads back and generates from."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import support

pytestmark = [pytest.mark.process, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_llama"
NAMESPACE = "e2e-hf-llama"
JOB = "hf-llama"
wait_until = partial(support.wait_until, timeout=300.0, interval=2.0)


def get(target, kind, name):
    result = target.kubectl("-n", NAMESPACE, "get", kind, name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def volume_folder(target, claim) -> Path:
    """The host folder the test cluster's provisioner made for a claim, once it is bound."""
    name = wait_until(lambda: ((get(target, "persistentvolumeclaim", claim) or {}).get("spec") or {}).get("volumeName"))
    return Path(get(target, "pv", name)["spec"]["hostPath"]["path"])


@pytest.mark.timeout(1800)
def test_the_hf_llama_example_trains_from_its_volume_and_exports_a_model_transformers_loads(target, operator):
    if target.cluster is None:
        pytest.skip("the example's data is copied into the volume's folder, which only the test cluster has here")
    if target.image_tag != "dev":
        pytest.skip(f"the example runs diloco-trainer:dev; this cluster's images are tagged {target.image_tag}")
    target.kubectl("create", "namespace", NAMESPACE)
    try:
        target.kubectl("-n", NAMESPACE, "apply", "-f", str(EXAMPLE / "volumes.yaml"))
        data = volume_folder(target, "hf-llama-data")  # as `kubectl cp` through a pod would fill it
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(EXAMPLE / name, data / name)
        shutil.copytree(EXAMPLE / "data", data / "data", dirs_exist_ok=True)
        target.kubectl("-n", NAMESPACE, "apply", "-f", str(EXAMPLE / "job.yaml"))

        def status():
            return (get(target, "dilocojob", JOB) or {}).get("status") or {}

        export = wait_until(lambda: (e := status().get("export") or {}).get("phase") == "Succeeded" and e, timeout=1500)
        assert status()["phase"] == "Succeeded" and export["location"] == f"models:/{JOB}"
        folder = volume_folder(target, "models") / JOB
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert model.config.model_type == "llama" and model.config.hidden_size == 128
        prompt = tokenizer("The operator", return_tensors="pt")
        text = tokenizer.decode(model.generate(**prompt, max_new_tokens=16, do_sample=False)[0])
        assert text.startswith("The operator") and len(text) > len("The operator")
        record = json.loads((folder / "diloco.json").read_text())
        assert record["outer_steps"] >= 4 and record["model"]["model_type"] == "llama"
    finally:
        target.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=180)
