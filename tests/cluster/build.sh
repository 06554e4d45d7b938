#!/usr/bin/env bash
# Builds the cluster-tier toolchain (DESIGN.md section 8) from the Go module proxy, because no
# release binary or container image can be downloaded on the machines this project runs on.
#
# Usage: BIN=$(tests/cluster/build.sh | tail -1)
#
# Each binary is cached under $CACHE/<name>-<version>/; a rerun with the binaries present does not
# invoke Go at all. Progress goes to stderr; stdout carries only the path of a directory of symlinks
# to every binary, as its last line.
set -euo pipefail
shopt -s inherit_errexit   # so a failing `go` inside $(...) stops the script too

ETCD_VERSION=v3.7.3   # server module; k8s v1.37 itself uses the v3.7 etcd client
K8S_VERSION=v1.37.2   # kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
KWOK_VERSION=v0.8.0
HELM_VERSION=v4.3.1
KIND_VERSION=v0.33.0
# Prometheus 3.x is tagged as Go module v0.3xx.y for its release 3.xx.y (v0.316.0 is Prometheus 3.16.0).
PROMETHEUS_VERSION=v0.316.0

source "$(dirname "${BASH_SOURCE[0]}")/buildlib.sh"

# --- etcd -------------------------------------------------------------------------------------
# The server module's own go.mod replaces its siblings (api, client/pkg, client/v3, pkg) with
# ../paths; as a dependency those replaces are ignored and its requirements on the published
# siblings at the same version apply. Its main package is the module root (server/main.go).
if ! cached etcd "$ETCD_VERSION"; then
    mod=$(new_module etcd "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
    build etcd "$ETCD_VERSION" "$mod" go.etcd.io/etcd/server/v3 "" --version
fi

# --- Kubernetes -------------------------------------------------------------------------------
k8s_mod=""   # set up on first need, then shared by the four builds (and their GOCACHE hits)
for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    if ! cached "$name" "$K8S_VERSION"; then
        [[ -n $k8s_mod ]] || k8s_mod=$(k8s_module)
        version_cmd=(--version)
        [[ $name != kubectl ]] || version_cmd=(version --client)
        build "$name" "$K8S_VERSION" "$k8s_mod" "k8s.io/kubernetes/cmd/$name" "$k8s_ldflags" "${version_cmd[@]}"
    fi
done

# --- KWOK, helm, kind: plain modules with no replace directives -----------------------------
# (helm's source carries only "v4.3"; kwok and kind carry their full version as constants.)
if ! cached kwok "$KWOK_VERSION"; then
    mod=$(new_module kwok "sigs.k8s.io/kwok@$KWOK_VERSION")
    build kwok "$KWOK_VERSION" "$mod" sigs.k8s.io/kwok/cmd/kwok "" --version
fi
# KWOK's own Stage configs, which the kwok binary no longer embeds: nodes that come up Ready and heartbeat
# through a Lease, pods that become Running and Ready with an IP from their node's podCIDR, Job pods that
# complete, deleted pods removed at once. Taken from the same release, next to the binary.
KWOK_STAGES=(node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease
             pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete)
stages=$CACHE/kwok-stages.yaml-$KWOK_VERSION
if [[ -s $stages/kwok-stages.yaml ]]; then
    log "[build] kwok-stages.yaml $KWOK_VERSION ... cached"
else
    src=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | jq -er .Dir)/kustomize/stage
    mkdir "$WORK/out-kwok-stages"
    for stage in "${KWOK_STAGES[@]}"; do
        { echo "---"; cat "$src/$stage.yaml"; } >>"$WORK/out-kwok-stages/kwok-stages.yaml"
    done
    mv -T "$WORK/out-kwok-stages" "$stages" 2>/dev/null || [[ -s $stages/kwok-stages.yaml ]]
    log "[build] kwok-stages.yaml $KWOK_VERSION ... done"
fi
if ! cached helm "$HELM_VERSION"; then
    mod=$(new_module helm "helm.sh/helm/v4@$HELM_VERSION")
    build helm "$HELM_VERSION" "$mod" helm.sh/helm/v4/cmd/helm \
        "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" version
fi
if ! cached kind "$KIND_VERSION"; then
    mod=$(new_module kind "sigs.k8s.io/kind@$KIND_VERSION")
    build kind "$KIND_VERSION" "$mod" sigs.k8s.io/kind "" version
fi

# --- Prometheus: the monitoring test's server (tests/operator/test_prometheus_queries.py) -----------------
# A plain module too. Built the way its Makefile builds without `make assets`: no `builtinassets` tag, so
# the web UI's assets are read from disk (and are absent; the test uses only the HTTP API). The
# `remove_all_sd` tag (its README's "Service discovery plugins") leaves out the cloud service discoveries
# and their SDKs, keeping static, file and HTTP SD: the test scrapes static targets on 127.0.0.1, and the
# build is several times shorter. The release's own version stamp (3.x.y) is set as promu sets it; the
# check is the module version Go records in the binary.
if ! cached prometheus "$PROMETHEUS_VERSION"; then
    IFS=. read -r _ prom_minor prom_patch <<<"${PROMETHEUS_VERSION#v}"
    mod=$(new_module prometheus "github.com/prometheus/prometheus@$PROMETHEUS_VERSION")
    GOFLAGS="${GOFLAGS:-} -tags=remove_all_sd" build prometheus "$PROMETHEUS_VERSION" "$mod" \
        github.com/prometheus/prometheus/cmd/prometheus \
        "-X github.com/prometheus/common/version.Version=$((prom_minor / 100)).$((prom_minor % 100)).$prom_patch"
fi

# --- bin dir: one per version set, so callers pinned to different versions never collide ---------
entries=(
    "etcd $ETCD_VERSION"
    "kube-apiserver $K8S_VERSION" "kube-controller-manager $K8S_VERSION"
    "kube-scheduler $K8S_VERSION" "kubectl $K8S_VERSION"
    "kwok $KWOK_VERSION" "kwok-stages.yaml $KWOK_VERSION" "helm $HELM_VERSION" "kind $KIND_VERSION"
    "prometheus $PROMETHEUS_VERSION"
)
bin=$CACHE/bin-$(printf '%s\n' "${entries[@]}" | sha256sum | cut -c1-12)
if [[ ! -d $bin ]]; then
    mkdir "$WORK/bin"
    for e in "${entries[@]}"; do
        read -r name version <<<"$e"
        ln -s "../$name-$version/$name" "$WORK/bin/$name"   # relative: the cache can be moved
    done
    mv -T "$WORK/bin" "$bin" 2>/dev/null || [[ -d $bin ]]   # a concurrent run may have made it
fi
echo "$bin"
