#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite (tests/e2e) on a real kind cluster with the project's images, the path for a
# machine with Docker where kind's node image can be pulled (the project's own images are built here without
# a registry, by deploy/images/build.sh as `make images` does). It cannot run where no image can be pulled;
# there `make test` runs the same suite on the KWOK test cluster instead.
#
# Environment: KIND_CLUSTER (default diloco-e2e), KEEP_CLUSTER=1 to leave the cluster running afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=$(bash tests/cluster/build.sh | tail -1)   # kind, kubectl and helm at the pinned versions
CLUSTER=${KIND_CLUSTER:-diloco-e2e}
TAG=e2e
KUBECONFIG_FILE=$(mktemp -t "kubeconfig-$CLUSTER.XXXXXX")

TAG=$TAG bash deploy/images/build.sh operator trainer
"$BIN/kind" create cluster --name "$CLUSTER" --config tests/e2e/kind.yaml --kubeconfig "$KUBECONFIG_FILE" --wait 180s
if [[ ${KEEP_CLUSTER:-} != 1 ]]; then
    trap '"$BIN/kind" delete cluster --name "$CLUSTER"; rm -f "$KUBECONFIG_FILE"' EXIT
fi
# Also as the image an update rolls the job onto, and as the :dev the README's examples name.
docker tag "diloco-trainer:$TAG" "diloco-trainer:$TAG-rolled"
docker tag "diloco-trainer:$TAG" "diloco-trainer:dev"
"$BIN/kind" load docker-image --name "$CLUSTER" "diloco-trainer:$TAG" "diloco-trainer:$TAG-rolled" \
    "diloco-trainer:dev" "diloco-operator:$TAG"

DILOCO_E2E_KUBECONFIG=$KUBECONFIG_FILE DILOCO_E2E_IMAGE_TAG=$TAG DILOCO_CLUSTER_BIN=$BIN \
    .venv/bin/python -m pytest -m e2e tests/e2e "$@"
