#!/usr/bin/env bash
# Builds the worker image the Kubernetes manifests (deploy/k8s) run, without a container
# builder: a Debian bookworm minbase rootfs from `debootstrap`, Python 3.11, and a venv at
# /opt/venv with the project's wheel and its pinned dependencies (.ci/constraints.txt)
# installed from the package registry. Writes an OCI image archive (one uncompressed
# layer) that `ctr images import`, `podman load` or `skopeo copy oci-archive:` read.
#
#   deploy/image/build.sh [--variant cpu|gpu] [--tag NAME:TAG] [--out FILE] [--import SOCKET]
#
# Variants:
#   cpu (default)  the simulated and transformers engines (extra `cpu`: the torch CPU wheel),
#                  plus `k8s` and `s3` (Dagster's run pods and S3 storage) in every variant.
#   gpu            the vLLM engine (extra `vllm`: vllm 0.32.0 and the CUDA torch wheel it
#                  pins). Run it on the GPU node's architecture; the NVIDIA driver comes from
#                  the node (the NVIDIA container toolkit mounts it), not from the image.
#
# Why not a Containerfile: the test machines have no container builder, and this script
# makes the same image anywhere debootstrap runs (root, or fakeroot-less sudo). Same steps
# as a Containerfile would take: FROM debian:bookworm-slim, apt python3 python3-venv,
# python -m venv /opt/venv, pip install batch_inference[EXTRA] -c constraints, USER 1000.
#
# Cached under ~/.cache/batch_inference/image in three steps: the base rootfs (keyed on the
# Debian suite and package list), the venv of pinned dependencies (keyed on the constraints,
# the wheel's Requires-Dist, the variant and DEPS_RECIPE) and the image (keyed on the wheel's
# contents). A code change rebuilds only the last (~1-2 min: mostly writing the ~1.4 GB
# archive). Prints the archive path on its last line.
set -euo pipefail

VARIANT=cpu TAG= OUT= IMPORT=
while (($#)); do
    case $1 in
        --variant) VARIANT=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --import) IMPORT=$2; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
# k8s + s3: the same image runs Dagster's run pods (K8sRunLauncher: dagster-k8s, dagster-postgres)
case $VARIANT in cpu) EXTRA=cpu,k8s,s3 ;; gpu) EXTRA=vllm,k8s,s3 ;; *) echo "--variant cpu|gpu" >&2; exit 2 ;; esac

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$(command -v python3)}
CACHE=${BATCH_INFERENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batch_inference}/image
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,tini
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
TAG=${TAG:-batch-inference:$VERSION-$VARIANT}
root() { if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi; }
sha() { sha256sum "$@" | cut -c1-64; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

# 1. Base rootfs (~4 min, ~200 MB): debootstrap minbase + Python.
base_key=$(printf '%s\n' "$SUITE" "$PACKAGES" | sha | cut -c1-12)
BASE=$CACHE/base-$SUITE-$base_key
if [[ ! -d $BASE ]]; then
    command -v debootstrap >/dev/null || root apt-get install -y -qq --no-install-recommends debootstrap
    tmp=$CACHE/base.tmp.$$
    root rm -rf "$tmp"
    t0=$SECONDS
    root debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    root rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*
    root mv "$tmp" "$BASE"
    echo "base rootfs built in $((SECONDS - t0)) s" >&2
fi

# 2. The dependencies (~5 min): a rootfs with /opt/venv holding every pinned dependency,
#    cached on the constraints, the variant, the base and this script, so a code change
#    rebuilds only the last step. Resolved on the host with the host's pip configuration
#    (same Debian release and Python minor version as the image), installed offline.
WORK=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'root rm -rf "$WORK"' EXIT
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/project" "$REPO" >/dev/null
WHEEL=$(ls "$WORK"/project/batch_inference-*.whl)
DEPS_RECIPE=1  # bump when step 2 changes
requires=$("$PYTHON" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
print("\n".join(sorted(l for l in z.read(meta).decode().splitlines() if l.startswith(("Requires-Dist", "Requires-Python")))))' "$WHEEL")
deps_key=$( { sha "$REPO/.ci/constraints.txt"; echo "$requires"; echo "$VARIANT $EXTRA $base_key $DEPS_RECIPE"; } | sha | cut -c1-12)
DEPS=$CACHE/deps-$VARIANT-$deps_key
if [[ ! -d $DEPS ]]; then
    t0=$SECONDS
    "$PYTHON" -m pip wheel -q --prefer-binary -w "$WORK/wheels" -c "$REPO/.ci/constraints.txt" \
        "$WHEEL[$EXTRA]" >"$WORK/pip-wheel.log" 2>&1 || { tail -20 "$WORK/pip-wheel.log" >&2; exit 1; }
    rm -f "$WORK"/wheels/batch_inference-*.whl
    echo "wheels resolved in $((SECONDS - t0)) s" >&2
    t0=$SECONDS
    tmp=$CACHE/deps.tmp.$$
    root rm -rf "$tmp"
    root cp -a "$BASE" "$tmp"
    root mkdir -p "$tmp/tmp/wheels"
    root cp "$WORK"/wheels/*.whl "$tmp/tmp/wheels/"
    root chroot "$tmp" /usr/bin/python3 -m venv /opt/venv
    root chroot "$tmp" /bin/sh -c 'exec /opt/venv/bin/pip install -q --no-cache-dir --no-index --no-deps /tmp/wheels/*.whl' \
        >"$WORK/pip-install.log" 2>&1 || { tail -20 "$WORK/pip-install.log" >&2; exit 1; }
    root rm -rf "$tmp/tmp/wheels" "$tmp/root/.cache"
    root find "$tmp/opt/venv" -name __pycache__ -prune -exec rm -rf {} +
    root mkdir -p "$tmp/home/app"
    root chown 1000:1000 "$tmp/home/app"
    root mv "$tmp" "$DEPS"
    echo "dependencies installed in $((SECONDS - t0)) s" >&2
fi

# 3. The project's wheel on top (seconds). The key hashes the wheel's contents, not the
#    wheel file (its zip timestamps change on every build).
key=$( { "$PYTHON" -c 'import hashlib, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in sorted(z.namelist()): print(n, hashlib.sha256(z.read(n)).hexdigest())' "$WHEEL"; echo "$deps_key"; sha "$0"; } | sha | cut -c1-16)
ARCHIVE=$CACHE/batch-inference-$VARIANT-$key.oci.tar
if [[ ! -f $ARCHIVE ]]; then
    t0=$SECONDS
    RFS=$WORK/rootfs
    root cp -a "$DEPS" "$RFS"
    root cp "$WHEEL" "$RFS/tmp/"
    root chroot "$RFS" /bin/sh -c 'exec /opt/venv/bin/pip install -q --no-cache-dir --no-index --no-deps /tmp/batch_inference-*.whl' \
        >"$WORK/pip-install.log" 2>&1 || { tail -20 "$WORK/pip-install.log" >&2; exit 1; }
    root chroot "$RFS" /opt/venv/bin/pip check >&2
    root rm -f "$RFS"/tmp/*.whl
    root find "$RFS/opt/venv" -name __pycache__ -prune -exec rm -rf {} +
    echo "project installed in $((SECONDS - t0)) s" >&2

    # 4. OCI image archive (deploy/image/oci_archive.py): one uncompressed tar layer.
    t0=$SECONDS
    root tar --numeric-owner --xattrs -C "$RFS" -cf "$WORK/layer.tar" .
    "$PYTHON" "$REPO/deploy/image/oci_archive.py" --layer "$WORK/layer.tar" --tag "$TAG" --out "$ARCHIVE" \
        --entrypoint '["/usr/bin/tini", "--"]' --cmd '["batch-inference", "--help"]' --user 1000:1000 \
        --workdir /home/app --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env HOME=/home/app --env PYTHONUNBUFFERED=1
    echo "OCI archive written in $((SECONDS - t0)) s ($(du -h "$ARCHIVE" | cut -f1))" >&2
    # the variant's archives of earlier code: ~1.5 GB each, one a code change (CI builds one a run)
    find "$CACHE" -maxdepth 1 -name "batch-inference-$VARIANT-*.oci.tar" ! -path "$ARCHIVE" -delete
fi
[[ -z $OUT ]] || cp "$ARCHIVE" "$OUT"
if [[ -n $IMPORT ]]; then
    root ctr -a "$IMPORT" -n k8s.io images import "$ARCHIVE" >&2
fi
echo "$ARCHIVE"
