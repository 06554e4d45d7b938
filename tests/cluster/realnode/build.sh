#!/usr/bin/env bash
# Builds what a real node needs beside the control plane that ../build.sh builds: the kubelet and
# kube-proxy (same k8s.io/kubernetes module and pin), the NetworkPolicy controller that kind's kindnetd
# runs (sigs.k8s.io/kube-network-policies), a pause image compiled from kubernetes' own
# build/pause/linux/pause.c, and a CoreDNS image for the cluster's DNS. containerd, runc, the CNI
# plugins and nft come from Debian (node.DEBIAN_PACKAGES); nothing is pulled from an image registry.
#
# Usage: tests/cluster/realnode/build.sh      (node.py finds both in the cache)
#
# Same cache conventions as ../build.sh ($CACHE/<name>-<version>/, atomic rename, progress on stderr).
set -euo pipefail
shopt -s inherit_errexit

here=$(dirname "${BASH_SOURCE[0]}")
K8S_VERSION=$(sed -n 's/^K8S_VERSION=\([^ ]*\).*/\1/p' "$here/../build.sh")   # pinned once, there
COREDNS_VERSION=v1.14.7
NETPOL_VERSION=v0.8.0

source "$here/../buildlib.sh"

k8s_mod=""   # set up on first need, then shared by both builds
for name in kubelet kube-proxy; do
    if ! cached "$name" "$K8S_VERSION"; then
        [[ -n $k8s_mod ]] || k8s_mod=$(k8s_module)
        build "$name" "$K8S_VERSION" "$k8s_mod" "k8s.io/kubernetes/cmd/$name" "$k8s_ldflags" --version
    fi
done

# --- kube-network-policies: NetworkPolicy enforced with nftables and nfqueue, as kindnetd does ---------
# Its source with kube-network-policies.patch applied (why: see there), in place of the module's.
if ! cached kube-network-policies "$NETPOL_VERSION"; then
    netpol_module=sigs.k8s.io/kube-network-policies
    mod=$(new_module netpol "$netpol_module@$NETPOL_VERSION")
    cp -r "$(go mod download -json "$netpol_module@$NETPOL_VERSION" | jq -er .Dir)" "$WORK/netpol-src"
    chmod -R u+w "$WORK/netpol-src"   # the module cache is read-only
    patch --quiet --forward -p1 -d "$WORK/netpol-src" <"$here/kube-network-policies.patch"
    (cd "$mod" && go mod edit -replace="$netpol_module=$WORK/netpol-src")
    build kube-network-policies "$NETPOL_VERSION" "$mod" "$netpol_module/cmd" ""
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

# --- CoreDNS: the cluster DNS image, with only the plugins its Corefile (dns.py) uses -----------------
# CoreDNS's own main imports every plugin (core/plugin), and with them every cloud provider's SDK; this
# main imports the eight the Corefile names and lists them in plugin.cfg's order (the order they run in).
COREDNS_IMAGE=registry.k8s.io/coredns/coredns:$COREDNS_VERSION
if cached coredns "$COREDNS_VERSION"; then
    :
else
    mod=$(new_module coredns "github.com/coredns/coredns@$COREDNS_VERSION")
    plugins=(ready health errors loadbalance cache kubernetes loop forward)
    {
        echo 'package main'
        echo 'import ('
        echo '    "github.com/coredns/coredns/core/dnsserver"'
        echo '    "github.com/coredns/coredns/coremain"'
        printf '    _ "github.com/coredns/coredns/plugin/%s"\n' "${plugins[@]}"
        echo ')'
        printf 'func init() { dnsserver.Directives = []string{%s} }\n' "$(printf '"%s", ' "${plugins[@]}")"
        echo 'func main() { coremain.Run() }'
    } >"$mod/main.go"
    build coredns "$COREDNS_VERSION" "$mod" . "" -version
fi
if [[ -s $CACHE/coredns-$COREDNS_VERSION/coredns.tar ]]; then
    log "[build] coredns image $COREDNS_VERSION ... cached"
else
    # Added to the cache entry after its atomic rename: written under another name, then renamed, so a
    # reader never sees half an archive.
    python3 "$here/ociimage.py" "$COREDNS_IMAGE" "$WORK/coredns.tar" \
        --add "$CACHE/coredns-$COREDNS_VERSION/coredns:/coredns" --user 65532:65532 --entrypoint /coredns
    echo "$COREDNS_IMAGE" >"$WORK/coredns.name"
    mv "$WORK/coredns.name" "$CACHE/coredns-$COREDNS_VERSION/name"
    mv "$WORK/coredns.tar" "$CACHE/coredns-$COREDNS_VERSION/coredns.tar"
    log "[build] coredns image $COREDNS_VERSION ... done"
fi
