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

CACHE=${DILOCO_CLUSTER_CACHE:-$HOME/.cache/diloco-cluster}

# Static binaries that need no C toolchain to build.
export CGO_ENABLED=0

log() { echo "$*" >&2; }

mkdir -p "$CACHE"
# Scratch space lives inside $CACHE so the final rename into place stays on one filesystem (atomic).
WORK=$(mktemp -d "$CACHE/.tmp.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

# new_module NAME MODULE@VERSION: a throwaway main module requiring MODULE@VERSION; prints its dir.
# A throwaway module is needed because `go install pkg@version` refuses any module whose go.mod has
# replace directives (etcd's server module and k8s.io/kubernetes both do), and replace directives
# are honoured only in the main module, so the ones k8s needs must live in a go.mod of our own.
new_module() {
    local dir=$WORK/mod-$1
    mkdir -p "$dir"
    (cd "$dir" && go mod init "diloco.local/cluster-$1" && go mod edit -require="$2")
    echo "$dir"
}

# build NAME VERSION MODDIR PACKAGE LDFLAGS VERSION_COMMAND...
# Builds PACKAGE inside MODDIR, checks that VERSION_COMMAND's output names VERSION, then renames the
# whole directory into place so an interrupted build never leaves a partial cache entry.
build() {
    local name=$1 version=$2 moddir=$3 pkg=$4 ldflags=$5
    shift 5
    local dest=$CACHE/$name-$version start=$SECONDS out=$WORK/out-$name reported
    log "[build] $name $version ..."
    mkdir -p "$out"
    # -mod=mod lets go fill in the throwaway module's go.sum and indirect requirements.
    (cd "$moddir" && nice -n 19 go build -mod=mod -trimpath -ldflags "-s -w $ldflags" -o "$out/$name" "$pkg")
    if ! reported=$("$out/$name" "$@" 2>&1) || [[ $reported != *"${version#v}"* ]]; then
        log "[build] $name: '$name $*' does not report $version: $reported"
        return 1
    fi
    # mv -T renames onto a missing (or empty) directory atomically; if a concurrent run won the
    # race, its finished entry is just as good.
    if ! mv -T "$out" "$dest" 2>/dev/null && [[ ! -x $dest/$name ]]; then
        log "[build] $name: cannot move the build into $dest (remove it?)"
        return 1
    fi
    log "[build] $name $version ... done in $((SECONDS - start))s ($(du -h "$dest/$name" | cut -f1))"
}

# cached NAME VERSION: true when the binary is in place (then no module is set up, no Go is run).
cached() {
    if [[ -x $CACHE/$1-$2/$1 ]]; then
        log "[build] $1 $2 ... cached"
        return 0
    fi
    return 1
}

# --- etcd -------------------------------------------------------------------------------------
# The server module's own go.mod replaces its siblings (api, client/pkg, client/v3, pkg) with
# ../paths; as a dependency those replaces are ignored and its requirements on the published
# siblings at the same version apply. Its main package is the module root (server/main.go).
if ! cached etcd "$ETCD_VERSION"; then
    mod=$(new_module etcd "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
    build etcd "$ETCD_VERSION" "$mod" go.etcd.io/etcd/server/v3 "" --version
fi

# --- Kubernetes -------------------------------------------------------------------------------
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0 and
# replaces them with ./staging/src paths, which the proxy cannot serve. Each staging module is
# published on its own as v0.<minor>.<patch>, so our module replaces every one that kubernetes
# requires with that version. The list comes from the release's go.mod, so it tracks K8S_VERSION.
IFS=. read -r k8s_major k8s_minor k8s_patch <<<"${K8S_VERSION#v}"
k8s_staging_version=v0.$k8s_minor.$k8s_patch
k8s_module() {
    local dir gomod staging m
    dir=$(new_module kubernetes "k8s.io/kubernetes@$K8S_VERSION")
    gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -er .GoMod)
    staging=$(go mod edit -json "$gomod" | jq -r '.Require[] | select(.Version == "v0.0.0") | .Path')
    for m in $staging; do
        (cd "$dir" && go mod edit -replace="$m=$m@$k8s_staging_version")
    done
    echo "$dir"
}
# What hack/lib/version.sh stamps into release builds: component-base feeds --version, /version
# and the compatibility-version machinery; client-go feeds kubectl's client version.
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$k8s_major -X $pkg.gitMinor=$k8s_minor"
    k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done
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

# --- bin dir: one per version set, so callers pinned to different versions never collide ---------
entries=(
    "etcd $ETCD_VERSION"
    "kube-apiserver $K8S_VERSION" "kube-controller-manager $K8S_VERSION"
    "kube-scheduler $K8S_VERSION" "kubectl $K8S_VERSION"
    "kwok $KWOK_VERSION" "kwok-stages.yaml $KWOK_VERSION" "helm $HELM_VERSION" "kind $KIND_VERSION"
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
