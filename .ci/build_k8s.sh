#!/usr/bin/env bash
# Builds the Kubernetes cluster the infra tests run against: kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy and kubectl 1.20.2 from
# Debian's `kubernetes` source package (every Go dependency vendored, so it builds offline
# with Debian's Go), plus etcd from Debian's `etcd-server`. No kubelet binary, k3s or kind
# exists in these registries, so the node components come from the same source.
#
# `--node` adds the node's binaries (kube-scheduler, kubelet, kube-proxy: `make test-pods`);
# without it only the control plane the infra tests use is built (`make test-infra`, CI).
# The binaries are cached outside the repo under a versioned path; only the missing ones
# are built (an older cache with the control plane alone gains the node binaries without
# rebuilding the rest). The first build takes ~7-11 min on 2 cores for the control plane
# and a few more for the node binaries. Idempotent, safe to run
# concurrently (flock), and the install is atomic (build elsewhere, then one rename).
# Prints the bin directory on its last line.
set -euo pipefail

K8S_VERSION=1.20.2
CACHE=${BATCH_INFERENCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batch_inference}
DEST=$CACHE/kubernetes-$K8S_VERSION
BINARIES=(kube-apiserver kube-controller-manager kubectl)
if [[ ${1:-} == --node ]]; then BINARIES+=(kube-scheduler kubelet kube-proxy); fi

missing_binaries() {  # prints the binaries not in the cache yet
    local b
    for b in "${BINARIES[@]}"; do [[ -x $DEST/bin/$b ]] || echo "$b"; done
}

apt_install() {  # apt_install PKG... : installs the ones that are missing
    local missing=() p
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    ((${#missing[@]})) || return 0
    local sudo=; [[ $(id -u) == 0 ]] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

mkdir -p "$CACHE"
exec 9>"$CACHE/kubernetes-$K8S_VERSION.lock"
flock 9

apt_install etcd-server
mapfile -t MISSING < <(missing_binaries)
if ((${#MISSING[@]} == 0)); then
    echo "$DEST/bin"
    exit 0
fi

apt_install golang-go rsync jq dpkg-dev ca-certificates
# `apt-get source` needs a deb-src line for the suite the base image uses.
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
    sudo=; [[ $(id -u) == 0 ]] || sudo=sudo
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
        | $sudo tee /etc/apt/sources.list.d/batch-inference-deb-src.sources >/dev/null
    $sudo apt-get update -qq
fi

WORK=$(mktemp -d "$CACHE/kubernetes-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
apt-get source -qq --download-only kubernetes >/dev/null
dpkg-source -x --no-check ./kubernetes_*.dsc src >/dev/null
upstream=$(dpkg-parsechangelog -l src/debian/changelog -S Version)
[[ $upstream == *"$K8S_VERSION"* ]] || { echo "Debian ships kubernetes $upstream, expected $K8S_VERSION" >&2; exit 1; }

# The old GOPATH layout the 1.20 build expects, with vendored dependencies.
mkdir -p gopath/src/k8s.io
mv src gopath/src/k8s.io/kubernetes
export GOPATH=$WORK/gopath GOCACHE=$WORK/gocache GO111MODULE=off CGO_ENABLED=0
cd "$GOPATH/src/k8s.io/kubernetes"
make gen_openapi >"$WORK/gen_openapi.log" 2>&1 || { tail -30 "$WORK/gen_openapi.log" >&2; exit 1; }
mkdir -p "$WORK/out/bin"
# Keep what is already cached; build only the missing binaries into the new tree.
[[ -d $DEST/bin ]] && cp -a "$DEST/bin/." "$WORK/out/bin/"
targets=(); for b in "${MISSING[@]}"; do targets+=("./cmd/$b"); done
v=k8s.io/kubernetes/vendor/k8s.io/component-base/version
go build -ldflags "-s -w -X $v.gitVersion=v$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION")" \
    -o "$WORK/out/bin/" "${targets[@]}"
echo "kubernetes $upstream (Debian source), $(go version)" >"$WORK/out/VERSION"

rm -rf "$DEST.old"
[[ -e $DEST ]] && mv "$DEST" "$DEST.old"
mv "$WORK/out" "$DEST"
rm -rf "$DEST.old"
echo "$DEST/bin"
