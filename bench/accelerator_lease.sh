#!/usr/bin/env bash
# One lease of an accelerator machine, prepared here and run there in one call (docs/training-benchmarks.md,
# "On an accelerator"): the `medium` preset in bf16, 4 islands sharing the GPU as processes, decoupled DiLoCo
# beside sync-diloco and ddp on the same tokens (bench/training.py loss), then the gpu test tier with what time
# is left. What each step prints is kept under $OUT as it goes, so a call cut short still returns it.
#
# That machine has torch but not all of our dependencies, and nothing can be fetched there: build the wheels
# here first (`bench/accelerator_wheels.sh`), then run this there with .whl carried.
#
# Usage: OUT=dir STEPS=320 LOSS_SECONDS=420 TIER_SECONDS=120 bench/accelerator_lease.sh
set -u
OUT=${OUT:-out/accelerator}
STEPS=${STEPS:-320}
LOSS_SECONDS=${LOSS_SECONDS:-420}
TIER_SECONDS=${TIER_SECONDS:-120}
mkdir -p "$OUT"
started=$SECONDS

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Away from the checkout: its diloco/ folder holds only part of the package (the rest is mapped from worker/,
# syncer/ and operator/), and a process started with -m from there would import it instead of the wheel.
OUT=$(realpath "$OUT")
rm -rf /tmp/work && mkdir /tmp/work && cp -r bench tests examples pyproject.toml /tmp/work && cd /tmp/work || exit 1
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nproc
} 2>&1 | tee "$OUT/device.txt"

# The loss comparison first: it is what the lease is for. Each mode may take a third of its time.
timeout "$LOSS_SECONDS" python3 bench/training.py loss --device cuda --preset medium --islands 4 --batch-size 8 \
  --steps "$STEPS" --inner-steps 20 --fragments 2 --seeds 0 --conditions quiet --no-sparse \
  --mode-timeout $((LOSS_SECONDS / 3)) --out /tmp/runs --png-dir "$OUT" 2>&1 | tee "$OUT/loss.log"
for mode in ddp diloco sync-diloco; do
  cp "/tmp/runs/loss/quiet-seed0/$mode/summary.json" "$OUT/summary-$mode.json" 2>/dev/null
done
echo "loss comparison done at $((SECONDS - started)) s" | tee -a "$OUT/loss.log"

timeout "$TIER_SECONDS" python3 -m pytest -m gpu -p no:cacheprovider -q tests/worker 2>&1 | tee "$OUT/gpu-tier.log"
echo "gpu tier done at $((SECONDS - started)) s" | tee -a "$OUT/gpu-tier.log"
