#!/usr/bin/env bash
# Checks built images the way a cluster runs them: as uid 10001, each command answers, the operator image
# imports every operator module without torch, and a syncer shard started from the trainer image serves
# gRPC health, its token-checked Status RPC and Prometheus metrics. Host network, bound to 127.0.0.1 only.
#   deploy/images/smoke.sh [operator] [trainer]      (default: both; TAG and DOCKER as for build.sh)
set -euo pipefail
DOCKER="${DOCKER:-docker}"
TAG="${TAG:-dev}"
images=("$@")
[[ ${#images[@]} -gt 0 ]] || images=(operator trainer)

check() {  # check WHAT EXPECTED COMMAND...: COMMAND's output must contain EXPECTED
  local what=$1 expected=$2 output
  shift 2
  if output="$("$@" 2>&1)" && [[ $output == *"$expected"* ]]; then
    echo "ok   $what: $(grep -F -m1 -- "$expected" <<<"$output")"
  else
    echo "FAIL $what: expected '$expected', got:" >&2
    tail -20 <<<"$output" >&2
    exit 1
  fi
}

for image in "${images[@]}"; do
  check "diloco-$image:$TAG runs as uid 10001" 10001 "$DOCKER" run --rm --entrypoint id "diloco-$image:$TAG" -u
done

if [[ " ${images[*]} " == *" operator "* ]]; then
  operator="diloco-operator:$TAG"
  check "$operator --help" "usage: diloco-operator" "$DOCKER" run --rm "$operator" --help
  check "$operator imports every operator module, without torch" "operator modules imported" \
    "$DOCKER" run --rm --entrypoint python "$operator" -c '
import importlib, importlib.util, pkgutil, diloco.operator as op
assert importlib.util.find_spec("torch") is None, "torch is installed"
names = [m.name for m in pkgutil.iter_modules(op.__path__)]
for name in names:
    importlib.import_module(f"diloco.operator.{name}")
print(len(names), "operator modules imported")'
fi

if [[ " ${images[*]} " == *" trainer "* ]]; then
  trainer="diloco-trainer:$TAG"
  check "$trainer diloco-syncer --help" "usage: diloco-syncer" "$DOCKER" run --rm "$trainer" diloco-syncer --help
  check "$trainer diloco-worker --help" "usage: diloco-worker" "$DOCKER" run --rm "$trainer" diloco-worker --help
  check "$trainer torch" "torch" "$DOCKER" run --rm "$trainer" python -c \
    'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

  free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
  port=$(free_port)
  metrics_port=$(free_port)
  syncer="diloco-smoke-syncer-$$"
  trap 'status=$?; [[ $status == 0 ]] || "$DOCKER" logs --tail 20 "$syncer" >&2; "$DOCKER" rm -f "$syncer" >/dev/null' EXIT
  "$DOCKER" run -d --network host --name "$syncer" -e DILOCO_TOKEN=smoke -e DILOCO_INSECURE_PLAINTEXT=1 "$trainer" \
    diloco-syncer \
    --host 127.0.0.1 --port "$port" --metrics-port "$metrics_port" --checkpoint-dir /tmp/checkpoints >/dev/null
  check "syncer from $trainer on 127.0.0.1:$port" "health SERVING" \
    "$DOCKER" run --rm --network host -e PORT="$port" -e METRICS_PORT="$metrics_port" "$trainer" python -c '
import os, urllib.request, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from diloco.transport.v1 import syncer_pb2, syncer_pb2_grpc
channel = grpc.insecure_channel("127.0.0.1:" + os.environ["PORT"])
grpc.channel_ready_future(channel).result(timeout=60)
health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
syncer = syncer_pb2_grpc.SyncerStub(channel)
try:
    syncer.Status(syncer_pb2.StatusRequest(), timeout=10)
    raise SystemExit("Status answered without a token")
except grpc.RpcError as error:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
syncer.Status(syncer_pb2.StatusRequest(), metadata=[("authorization", "Bearer smoke")], timeout=10)
metrics_url = "http://127.0.0.1:" + os.environ["METRICS_PORT"] + "/metrics"
metrics = urllib.request.urlopen(metrics_url, timeout=10).read()
assert b"diloco_syncer_" in metrics, "no syncer metrics"
print("health", health_pb2.HealthCheckResponse.ServingStatus.Name(health.status),
      "| Status refused without token, answered with it | metrics served")'
fi
