#!/usr/bin/env bash
# Builds the project's images on this machine from local files, with no registry: the Python base image
# (base.sh: debootstrap from the Debian mirror), the wheels (wheels.sh: PyPI), then each image offline
# (--network none, pip --no-index from wheels/), then checks them (smoke.sh). Prints each step's time and
# the images' sizes. `make images` runs it.
#   deploy/images/build.sh [operator] [trainer]      (default: both)
# Settings: TAG (dev), BASE_IMAGE (diloco/python:3.11-bookworm), DOCKER (docker), REBUILD=1 (base again).
set -euo pipefail
cd "$(dirname "$0")/../.."
DOCKER="${DOCKER:-docker}"
TAG="${TAG:-dev}"
BASE_IMAGE="${BASE_IMAGE:-diloco/python:3.11-bookworm}"
images=("$@")
[[ ${#images[@]} -gt 0 ]] || images=(operator trainer)
for image in "${images[@]}"; do
  [[ -f deploy/Dockerfile.$image ]] || { echo "no deploy/Dockerfile.$image" >&2; exit 2; }
done

step() {
  local name=$1 start=$SECONDS
  shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - start)) s"
}

# Offline: no network in the build, pip only from wheels/; labelled with the digest of its sources
# (context.py); the full log in out/images/.
build_image() {
  local image=$1 log=out/images/$1.log
  mkdir -p out/images
  echo "   log: $log"
  if ! "$DOCKER" build --network none -f "deploy/Dockerfile.$image" --build-arg PYTHON_IMAGE="$BASE_IMAGE" \
      --build-arg PIP_ARGS="--no-index --find-links /src/wheels" --label "$(python3 deploy/images/context.py "$image")" \
      -t "diloco-$image:$TAG" . >"$log" 2>&1; then
    tail -30 "$log" >&2
    return 1
  fi
}

step "base image $BASE_IMAGE" deploy/images/base.sh "$BASE_IMAGE"
step "wheels" deploy/images/wheels.sh
for image in "${images[@]}"; do
  step "diloco-$image:$TAG" build_image "$image"
done
step "smoke test" deploy/images/smoke.sh "${images[@]}"
built=("$BASE_IMAGE")
for image in "${images[@]}"; do built+=("diloco-$image:$TAG"); done
for name in "${built[@]}"; do
  echo "$name: $("$DOCKER" image inspect -f '{{.Size}}' "$name" | awk '{printf "%.0f MB", $1 / 1e6}')"
done
