#!/usr/bin/env bash
# import.sh CONTAINERD_CONFIG LOG TAGS IMAGE.tar...: imports OCI archives into the containerd store that
# CONTAINERD_CONFIG names (namespace k8s.io, unpacked), for node.py to give each node a copy of by hard links;
# then gives images more names: TAGS is `IMAGE=NEW_NAME,...` (or empty).
# node.py runs it as the first process of its own PID and mount namespaces, like node.sh: containerd, its
# sockets on a private /run, go when it exits.
set -euo pipefail
config=$1 log=$2 tags=$3
shift 3
mount -t tmpfs tmpfs /run
containerd --config "$config" >>"$log" 2>&1 &
ctr=(ctr --address /run/containerd/containerd.sock --namespace k8s.io)
for _ in $(seq 100); do
    "${ctr[@]}" version >/dev/null 2>&1 && break
    sleep 0.2
done
for image in "$@"; do
    "${ctr[@]}" images import "$image" >>"$log" 2>&1
done
IFS=, read -ra pairs <<<"$tags"
for pair in "${pairs[@]}"; do
    "${ctr[@]}" images tag "${pair%%=*}" "${pair#*=}" >>"$log" 2>&1
done
