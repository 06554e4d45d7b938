#!/usr/bin/env bash
# The wheels bench/accelerator_lease.sh installs on the accelerator machine, whose Python (3.12) has torch,
# numpy, tokenizers, safetensors, tqdm, matplotlib, pytest and hypothesis but not the rest of what `diloco run`
# and the gpu tier import, and which can fetch nothing: our package and those dependencies, at this virtualenv's
# versions, for CPython 3.12 on x86-64 Linux, into .whl/ (ignored by git; about 36 MB, under the 64 MiB a call
# may carry).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
pins=()
for name in grpcio grpcio-health-checking protobuf pydantic pydantic-core annotated-types typing-inspection \
  cryptography cffi pycparser python-json-logger transformers kubernetes aiohttp-retry durationpy oauthlib \
  requests-oauthlib websocket-client; do
  pins+=("$name==$(.venv/bin/python -m pip show "$name" | sed -n 's/^Version: //p')")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl .
du -sh .whl
