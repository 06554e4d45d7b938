#!/usr/bin/env bash
# Builds what a real node needs beside the control plane that ../build.sh builds: the kubelet (same
# k8s.io/kubernetes module and pin), containerd 2.x (the kubelet of this release refuses 1.x), and a
# pause image compiled from kubernetes' own build/pause/linux/pause.c. runc and the CNI plugins come
# from Debian (see ensure_debian_packages below); nothing is pulled from an image registry.
#
# Usage: tests/cluster/realnode/build.sh      (node.py finds both in the cache)
#
# Same cache conventions as ../build.sh ($CACHE/<name>-<version>/, atomic rename, progress on stderr).
set -euo pipefail
shopt -s inherit_errexit

here=$(dirname "${BASH_SOURCE[0]}")
K8S_VERSION=$(sed -n 's/^K8S_VERSION=\([^ ]*\).*/\1/p' "$here/../build.sh")   # pinned once, there
CONTAINERD_VERSION=v2.2.1

source "$here/../buildlib.sh"

if ! cached kubelet "$K8S_VERSION"; then
    build kubelet "$K8S_VERSION" "$(k8s_module)" k8s.io/kubernetes/cmd/kubelet "$k8s_ldflags" --version
fi

# --- pause: the sandbox image, from the same kubernetes release ------------------------------------
# build/pause/Makefile's TAG is the image version the release expects; compiled as its Makefile does.
k8s_src=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -er .Dir)
PAUSE_VERSION=$(sed -n 's/^TAG ?= //p' "$k8s_src/build/pause/Makefile")
PAUSE_IMAGE=registry.k8s.io/pause:$PAUSE_VERSION
if [[ -s $CACHE/pause-$PAUSE_VERSION/pause.tar ]]; then
    log "[build] pause $PAUSE_VERSION ... cached"
else
    log "[build] pause $PAUSE_VERSION ..."
    mkdir "$WORK/out-pause"
    gcc -Os -Wall -Werror -static "-DVERSION=v$PAUSE_VERSION-$K8S_VERSION" -o "$WORK/pause" "$k8s_src/build/pause/linux/pause.c"
    python3 "$here/ociimage.py" "$PAUSE_IMAGE" "$WORK/out-pause/pause.tar" --add "$WORK/pause:/pause" \
        --user 65535:65535 --entrypoint /pause
    echo "$PAUSE_IMAGE" >"$WORK/out-pause/name"
    mv -T "$WORK/out-pause" "$CACHE/pause-$PAUSE_VERSION" 2>/dev/null || [[ -s $CACHE/pause-$PAUSE_VERSION/pause.tar ]]
    log "[build] pause $PAUSE_VERSION ... done"
fi
