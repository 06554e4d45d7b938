# Sourced by build.sh and realnode/build.sh: the cache layout ($CACHE/<name>-<version>/, filled by an
# atomic rename) and the way a Go binary is built from the module proxy. Expects the version pins
# (K8S_VERSION) to be set by the caller, and `set -euo pipefail` with inherit_errexit.

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

# build NAME VERSION MODDIR PACKAGE LDFLAGS [VERSION_COMMAND...]
# Builds PACKAGE inside MODDIR, checks that VERSION_COMMAND's output names VERSION, then renames the
# whole directory into place so an interrupted build never leaves a partial cache entry. A binary with
# no version command is checked by the version of PACKAGE's module that Go recorded in it instead.
build() {
    local name=$1 version=$2 moddir=$3 pkg=$4 ldflags=$5
    shift 5
    local dest=$CACHE/$name-$version start=$SECONDS out=$WORK/out-$name reported
    log "[build] $name $version ..."
    mkdir -p "$out"
    # -mod=mod lets go fill in the throwaway module's go.sum and indirect requirements.
    (cd "$moddir" && nice -n 19 go build -mod=mod -trimpath -ldflags "-s -w $ldflags" -o "$out/$name" "$pkg")
    local check=("$out/$name" "$@")
    [[ $# -gt 0 ]] || check=(module_version "$out/$name" "$pkg")
    if ! reported=$("${check[@]}" 2>&1) || [[ $reported != *"${version#v}"* ]]; then
        log "[build] $name: '${check[*]}' does not report $version: $reported"
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

# module_version BINARY PACKAGE: the module that provides PACKAGE and its version, as Go recorded them in
# BINARY (`go version -m` lists the main package's module as: mod MODULE VERSION SUM, and each other as dep).
module_version() {
    go version -m "$1" | awk -v pkg="$2" '($1 == "mod" || $1 == "dep") && index(pkg, $2) == 1 {print $2, $3}'
}

# cached NAME VERSION: true when the binary is in place (then no module is set up, no Go is run).
cached() {
    if [[ -x $CACHE/$1-$2/$1 ]]; then
        log "[build] $1 $2 ... cached"
        return 0
    fi
    return 1
}

# --- Kubernetes -------------------------------------------------------------------------------------
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
