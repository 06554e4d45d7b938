#!/usr/bin/env bash
# What the test tiers need beyond the virtualenv, prepared the same way for `make test` and CI (.ci/run calls
# `make test`, which runs this first): the system tools of the pod network and the two-cluster link, and the
# cluster binaries (tests/cluster/build.sh, built once from the Go module proxy and cached under
# ~/.cache/diloco-cluster, so only a new machine pays for the build).
#
# Usage: DILOCO_CLUSTER_BIN=$(bash tests/prepare.sh | tail -1)
#
# Each tier that cannot run on this machine says why in one line on stderr, before the run starts; its tests
# then skip (or fail, under CI=1). stdout's last line is the binaries' directory, or empty without one.
set -uo pipefail
cd "$(dirname "$0")/.."
say() { echo "[test] $*" >&2; }

# The tools the pod runner's network (ip, nsenter, unshare), the two-cluster link (tc, iptables) and
# build.sh (jq) call, with the Debian package of each.
declare -A PACKAGE=([ip]=iproute2 [tc]=iproute2 [iptables]=iptables [nsenter]=util-linux [unshare]=util-linux
                    [jq]=jq)
missing_tools() { for tool in "${!PACKAGE[@]}"; do command -v "$tool" >/dev/null || echo "$tool"; done; }
mapfile -t missing < <(missing_tools)
if ((${#missing[@]})) && [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    mapfile -t packages < <(for tool in "${missing[@]}"; do echo "${PACKAGE[$tool]}"; done | sort -u)
    say "installing ${packages[*]} (apt-get) for the pod network and the two-cluster link"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${packages[@]}"; } >/dev/null
    mapfile -t missing < <(missing_tools)
fi
if ((${#missing[@]})); then
    say "pod-network and two-cluster tests cannot run: ${missing[*]} missing (as root: apt-get install" \
        "$(for tool in "${missing[@]}"; do echo "${PACKAGE[$tool]}"; done | sort -u | xargs))"
fi
if [[ $EUID -ne 0 ]]; then
    say "two-cluster link and PID-namespace tests skip: they need root (run make test as root)"
fi

# The cluster and e2e tiers: a control plane, KWOK and helm built from the Go module proxy.
if bin=$(bash tests/cluster/build.sh | tail -1) && [[ -n $bin ]]; then
    say "cluster binaries: $bin"
    echo "$bin"
elif ! command -v go >/dev/null; then
    say "cluster and e2e tiers cannot run: tests/cluster/build.sh needs Go (https://go.dev/dl, on PATH)"
else
    say "cluster and e2e tiers cannot run: tests/cluster/build.sh failed (its output is above)"
fi
