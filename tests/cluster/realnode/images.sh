#!/usr/bin/env bash
# Builds the project's images with `make images` (deploy/images/build.sh) for the real node, and saves each
# as an archive that node.py preloads into containerd (no registry between them).
#
# Usage: tests/cluster/realnode/images.sh [operator] [trainer]     (root; Debian's docker.io and debootstrap)
#
# deploy/images/build.sh needs a Docker daemon. This one is Debian's dockerd, started here in network, mount
# and PID namespaces of its own: its builds run with --network none anyway, so it needs no bridge and writes
# no iptables rule on the host, and stopping it leaves no mount. Its data stays in $CACHE/docker so the base
# image and layers are reused. The archives go to $CACHE/images/<image>-<tag>.tar; the last line of stdout
# is that directory. The wheels (3 GB, wheels.sh) are kept in $CACHE/wheels too, shared by every checkout as
# hard links: a new checkout downloads nothing, and after a source change only the source layers are built
# again (about 2 minutes for the trainer here, half of it `docker save`). Each image is labelled with the
# digest of its sources (deploy/images/context.py), which the real-node tests compare with the checkout's; an
# image whose archive already carries this checkout's digest is not built again.
set -euo pipefail
shopt -s inherit_errexit

cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
CACHE=${DILOCO_CLUSTER_CACHE:-$HOME/.cache/diloco-cluster}
TAG=${TAG:-dev}
images=("$@")
[[ ${#images[@]} -gt 0 ]] || images=(operator trainer)
stale=$(python3 tests/cluster/realnode/archives.py "${images[@]}")
read -ra images <<<"$stale"
if [[ ${#images[@]} -eq 0 ]]; then
    echo "[images] the archives are this checkout's already" >&2
    echo "$CACHE/images"
    exit 0
fi
docker_dir=$CACHE/docker
mkdir -p "$docker_dir" "$CACHE/images"
export DOCKER_HOST=unix://$docker_dir/docker.sock

# The daemon: lo up, a private /run, no bridge, no iptables. Its containerd is started first, as dockerd's
# own wait for one it starts itself times out on a loaded machine.
unshare --net --mount --pid --fork --mount-proc --propagation private bash -c '
    set -e
    ip link set lo up
    mount -t tmpfs tmpfs /run
    containerd --root "$1/containerd" --state /run/containerd --address /run/containerd/containerd.sock &
    exec dockerd --data-root "$1/data" --exec-root /run/docker -H "unix://$1/docker.sock" \
        --containerd /run/containerd/containerd.sock --pidfile /run/docker.pid \
        --bridge none --iptables=false --ip-forward=false --ip-masq=false' \
    _ "$docker_dir" >>"$docker_dir/dockerd.log" 2>&1 </dev/null &
daemon=$!
# unshare ignores SIGTERM while it waits: stop dockerd, the namespace's PID 1, and everything in it goes.
trap 'kill -TERM $(cat /proc/$daemon/task/$daemon/children) 2>/dev/null; wait $daemon || true' EXIT
for _ in $(seq 300); do
    docker version >/dev/null 2>&1 && break
    sleep 0.3
done

[[ -e wheels || ! -d $CACHE/wheels ]] || cp -al "$CACHE/wheels" wheels
TAG=$TAG deploy/images/build.sh "${images[@]}" >&2
rm -rf "$CACHE/wheels.new"
cp -al wheels "$CACHE/wheels.new"
rm -rf "$CACHE/wheels"
mv "$CACHE/wheels.new" "$CACHE/wheels"
for image in "${images[@]}"; do
    start=$SECONDS
    archive=$CACHE/images/diloco-$image-$TAG.tar
    rm -f "$archive"  # first: the trainer's is 6 GB, and the disk may not hold two
    docker save "diloco-$image:$TAG" -o "$archive.part"
    mv "$archive.part" "$archive"
    echo "[images] diloco-$image:$TAG saved in $((SECONDS - start)) s" >&2
done
echo "$CACHE/images"
