#!/usr/bin/env bash
# Downloads every wheel the images install (the runtime dependencies pinned in pyproject.toml and what
# building the diloco wheel needs) into wheels/, so that the image builds run offline with
# PIP_ARGS="--no-index --find-links /src/wheels". Wheels only, for CPython 3.11 on this host's platform:
# run it on Linux x86_64, like the images. Skipped when wheels/ already holds this exact requirement list.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"

wanted="$("$PYTHON" deploy/images/requirements.py trainer)
$("$PYTHON" deploy/images/requirements.py build)"
if [[ -f wheels/.requirements && "$(cat wheels/.requirements)" == "$wanted" ]]; then
  echo "wheels/ is up to date with pyproject.toml"
  exit 0
fi
mapfile -t requirements <<<"$wanted"
echo "pip download into wheels/ (about 3 GB the first time: torch and its CUDA libraries)"
"$PYTHON" -m pip download --quiet --dest wheels --only-binary=:all: --python-version 3.11 "${requirements[@]}"
printf '%s\n' "$wanted" >wheels/.requirements
echo "wheels/: $(find wheels -name '*.whl' | wc -l) wheels, $(du -sh wheels | cut -f1)"
