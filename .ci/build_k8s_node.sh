#!/usr/bin/env bash
# What a real Kubernetes node needs in the infra tests, beside the binaries .ci/build_k8s.sh
# builds (kubelet, kube-scheduler, kube-proxy): containerd, runc, the CNI plugins, iptables
# and conntrack from apt; the pod sandbox ("pause") image, built from .ci/pause/pause.c
# since no registry is reachable to pull k8s.gcr.io/pause from; and the project's worker
# image (deploy/image/build.sh: debootstrap rootfs + venv with the wheel and pinned deps).
#
# Images are OCI archives cached under ~/.cache/batch_inference/image, keyed on their
# inputs; the test fixture imports them into its own containerd. Prints two lines:
#   PAUSE_ARCHIVE=...   IMAGE_ARCHIVE=...
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${BATCH_INFERENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batch_inference}/image
PYTHON=${PYTHON:-$(command -v python3)}
root() { if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi; }

missing=()
for p in containerd runc containernetworking-plugins iptables conntrack debootstrap gcc libc6-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$CACHE"
key=$(cat .ci/pause/pause.c deploy/image/oci_archive.py | sha256sum | cut -c1-12)
PAUSE=$CACHE/pause-$key.oci.tar
if [[ ! -f $PAUSE ]]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/rootfs"
    gcc -static -Os -s -o "$work/rootfs/pause" .ci/pause/pause.c
    tar --numeric-owner --owner=0 --group=0 -C "$work/rootfs" -cf "$work/layer.tar" pause
    "$PYTHON" deploy/image/oci_archive.py --layer "$work/layer.tar" --tag batch-inference.test/pause:3.2 \
        --out "$PAUSE" --entrypoint '["/pause"]' --user 65535:65535
fi
echo "PAUSE_ARCHIVE=$PAUSE"
echo "IMAGE_ARCHIVE=$(bash deploy/image/build.sh --variant cpu | tail -1)"
