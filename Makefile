# Entry points that work from a fresh clone: each target makes the virtualenv it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint unit e2e e2e-kind e2e-realnode test-realnode cluster-up protos bench-syncer bench-comm bench-simulator syncer images clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# An editable install leaves our own modules uncompiled: the first run's processes would each compile them.
	$(BIN)/python -m compileall -q diloco operator syncer worker
	touch $(STAMP)

run: $(STAMP)  ## the embedded default: a syncer and 4 islands on loopback train the tiny GPT (about 3 min)
	$(BIN)/diloco run

test: $(STAMP)  ## every tier CI runs: tests/prepare.sh first readies what they need, or says why a tier cannot run
	DILOCO_CLUSTER_BIN=$$(bash tests/prepare.sh | tail -1) $(BIN)/python -m pytest

lint: $(STAMP)  ## static checks: ruff (lint and format), mypy strict on core/transport/api/syncer, the import layers
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tests/typecheck_tree.py
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layers.py

unit: $(STAMP)  ## only the pure-logic tests
	$(BIN)/python -m pytest -m "not process"

e2e: $(STAMP)  ## the end-to-end suite through helm and kubectl on the KWOK test cluster (needs tests/cluster/build.sh)
	$(BIN)/python -m pytest -m e2e tests/e2e

e2e-kind: $(STAMP)  ## the same suite on a new kind cluster with the images built here (needs Docker and image pulls)
	tests/e2e/kind.sh

test-realnode: $(STAMP)  ## pods as real containers on real nodes (kubelet, containerd, kube-proxy, CoreDNS), as root: docs/real-nodes.md
	tests/cluster/realnode/build.sh >/dev/null
	DILOCO_REALNODE=1 $(BIN)/python -m pytest -p no:cacheprovider tests/cluster/realnode

e2e-realnode: $(STAMP)  ## the e2e suite on real nodes running the images built here, as root: docs/real-nodes.md
	tests/cluster/realnode/build.sh >/dev/null
	tests/cluster/realnode/images.sh operator trainer >/dev/null
	DILOCO_E2E_REALNODE=1 $(BIN)/python -m pytest -m e2e -p no:cacheprovider tests/e2e

cluster-up: $(STAMP)  ## the KWOK test cluster and its pod runner, by hand: prints a KUBECONFIG, Ctrl-C stops it
	PYTHONPATH=tests $(BIN)/python -m cluster.up

protos: $(STAMP)  ## regenerate the gRPC stubs from protos/
	$(BIN)/python protos/generate.py

bench-syncer: $(STAMP)  ## merge-and-serve throughput of one shard vs raw loopback
	$(BIN)/python bench/syncer_throughput.py

.PHONY: bench-syncer-merge
bench-syncer-merge: $(STAMP)  ## a shard's merges and compressed pulls (16 M, 62 M fragments) vs today's path and a plain copy (~12 min on 2 busy cores)
	$(BIN)/python bench/syncer_merge.py

bench-comm: $(STAMP)  ## communication bytes per token, DiLoCo with int4 and sparse at the default H vs ddp, same machine
	$(BIN)/python bench/comm_bytes.py

bench-simulator: $(STAMP)  ## diloco simulate's goodput predictions vs diloco run --compare on one failure trace (~5 min)
	$(BIN)/python bench/simulate_vs_run.py

.PHONY: bench-loss bench-merge-rules bench-step-time bench-goodput bench-accelerator bench-wan bench-mixed-hardware
bench-loss: $(STAMP)  ## held-out loss at equal tokens over 3 seeds, quiet and jittered: decoupled DiLoCo vs sync-diloco and ddp (~40 min)
	$(BIN)/python bench/training.py loss

bench-merge-rules: $(STAMP)  ## the outer update rule by experiment: the global model of the same pushes grouped differently in time (~45 min)
	$(BIN)/python bench/merge_rules.py

bench-step-time: $(STAMP)  ## training-step time with syncing on vs off, alternating repeats (~5 min)
	$(BIN)/python bench/training.py step-time

bench-goodput: $(STAMP)  ## goodput under one failure trace: decoupled vs sync-diloco vs ddp (~5 min)
	$(BIN)/python bench/training.py goodput

bench-wan: $(STAMP)  ## step rate behind 12B-equivalent WAN links (netns, tbf, delay; root): decoupled vs sync-diloco vs ddp (~12 min)
	$(BIN)/python bench/wan.py

bench-mixed-hardware: $(STAMP)  ## islands at speeds 1,1,1,3 and 1,1,2,2: time to a held-out loss, speed-aware vs fixed H vs sync-diloco vs ddp (~8 min)
	$(BIN)/python bench/mixed_hardware.py

bench-accelerator: $(STAMP)  ## one GPU: tokens/s, MFU and peak memory of the medium and xl presets, bf16 vs fp32 (~2 min)
	$(BIN)/python bench/accelerator.py

.PHONY: bench-operator
bench-operator: $(STAMP)  ## operator: kubectl apply of 100 islands x 8 pods to children and status current, KWOK cluster
	$(BIN)/python bench/operator_scale.py

syncer: $(STAMP)  ## one syncer shard on loopback, token "dev", plaintext, checkpoints in ./out/syncer
	DILOCO_TOKEN=dev $(BIN)/diloco-syncer --host 127.0.0.1 --port 50051 --metrics-port 9090 --checkpoint-dir out/syncer \
		--insecure-plaintext

images:  ## the base, operator and trainer images, built offline with the local Docker engine (deploy/README.md)
	deploy/images/build.sh

clean:
	rm -rf $(VENV) out .pytest_cache
