#!/usr/bin/env bash
# Builds the local cluster's binaries (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, etcd, helm, and Kueue's manager and scheduler-plugins' scheduler for their tests) from
# the committed Go wrapper modules under e2e/tools/ into a cache folder outside the repo, keyed by
# their versions:
#     ${LIVESHARD_CACHE:-$HOME/.cache/liveshard}/bin/k8s-v<K>_etcd-v<E>_helm-v<H>_<digest>/
# A no-op when that folder is complete. Installs a Go toolchain from the Go module proxy when no
# suitable `go` is found. Exits non-zero with a message on any failure.
set -euo pipefail

# Everything is in main, called on the last line together with exit, so that bash has parsed
# the whole file before running it: editing the script while a build runs cannot derail it.
main() {
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
source "$here/versions.env"

cache=${LIVESHARD_CACHE:-$HOME/.cache/liveshard}
# The key also carries a digest of this script, versions.env and the wrapper modules, so any
# change to flags or dependencies builds afresh (liveshard_e2e.binaries computes the same).
digest=$(cd "$here" && cat build.sh versions.env tools/etcd/go.mod tools/etcd/go.sum \
         tools/k8s/go.mod tools/k8s/go.sum tools/kueue/go.mod tools/kueue/go.sum \
         | sha256sum | cut -c1-10)
key="k8s-v${K8S_VERSION}_etcd-v${ETCD_VERSION}_helm-v${HELM_VERSION}_${digest}"
out="$cache/bin/$key"
binaries=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd helm kueue
          kube-scheduler-plugins)

fail() { echo "e2e/build.sh: error: $*" >&2; exit 1; }
log() { echo "e2e/build.sh: $(date +%H:%M:%S) $*" >&2; }

complete() {
    [ -e "$out/.complete" ] || return 1
    for b in "${binaries[@]}"; do [ -x "$out/$b" ] || return 1; done
}

if complete; then
    log "binaries present in $out"
    exit 0
fi

mkdir -p "$cache/bin"
# One build at a time per cache (scripts/test and a developer may both start one).
exec 9>"$cache/bin/.build.lock"
flock 9
if complete; then
    log "binaries present in $out (built by a concurrent run)"
    exit 0
fi

# --- a Go toolchain --------------------------------------------------------------------------
go_ok() {  # go binary >= GO_MIN_VERSION?
    local v
    v=$("$1" env GOVERSION 2>/dev/null) || return 1
    v=${v#go}
    [ "$(printf '%s\n%s\n' "$GO_MIN_VERSION" "$v" | sort -V | head -1)" = "$GO_MIN_VERSION" ]
}
go=""
for cand in "${LIVESHARD_GO:-}" "$(command -v go || true)" /usr/local/go/bin/go \
            "$cache/go/go/bin/go"; do
    if [ -n "$cand" ] && [ -x "$cand" ] && go_ok "$cand"; then go=$cand; break; fi
done
if [ -z "$go" ]; then
    # The toolchain is itself a module on the Go module proxy (golang.org/toolchain).
    arch=$(uname -m); case $arch in x86_64) arch=amd64;; aarch64) arch=arm64;; esac
    tv="v0.0.1-go${GO_TOOLCHAIN_VERSION}.linux-$arch"
    proxy=${GOPROXY:-https://proxy.golang.org}; proxy=${proxy%%,*}
    log "no Go >= $GO_MIN_VERSION found; fetching golang.org/toolchain@$tv from $proxy"
    rm -rf "$cache/go.tmp"; mkdir -p "$cache/go.tmp"
    python3 - "$proxy/golang.org/toolchain/@v/$tv.zip" "$cache/go.tmp" <<'PY' \
        || fail "could not fetch the Go toolchain from the module proxy"
import io, os, sys, urllib.request, zipfile
data = urllib.request.urlopen(sys.argv[1], timeout=600).read()
with zipfile.ZipFile(io.BytesIO(data)) as z:
    for info in z.infolist():
        # strip the module prefix golang.org/toolchain@<version>/
        name = info.filename[info.filename.index("/", info.filename.index("@")) + 1 :]
        if not name:
            continue
        path = f"{sys.argv[2]}/go/{name}"
        if info.is_dir():
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(z.read(info))
        if (info.external_attr >> 16) & 0o111 or "/bin/" in path or "/pkg/tool/" in path:
            os.chmod(path, 0o755)
PY
    rm -rf "$cache/go"; mv "$cache/go.tmp" "$cache/go"
    go="$cache/go/go/bin/go"
    go_ok "$go" || fail "the fetched Go toolchain at $go does not run"
fi
command -v flock >/dev/null || fail "flock (util-linux) is required"
log "using $go ($("$go" env GOVERSION))"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly
tmp="$out.tmp"
rm -rf "$tmp"; mkdir -p "$tmp"
start=$(date +%s)

build() {  # build <wrapper dir> <ldflags> <package> <binary name>
    local dir=$1 ld=$2 pkg=$3 name=$4 t0=$SECONDS
    log "building $name"
    (cd "$here/tools/$dir" && "$go" build -trimpath -ldflags "$ld" -o "$tmp/$name" "$pkg") \
        || fail "go build of $name ($pkg in e2e/tools/$dir) failed"
    log "built $name in $((SECONDS - t0)) s"
}

module_dir() {  # module_dir <wrapper dir> <module>: where the module's files are (for its CRDs)
    (cd "$here/tools/$1" && "$go" list -m -f '{{.Dir}}' "$2") || fail "cannot locate the $2 module"
}

V=k8s.io/component-base/version
CV=k8s.io/client-go/pkg/version
minor=$(echo "$K8S_VERSION" | cut -d. -f2)
zero=0000000000000000000000000000000000000000
kld="-s -w"
for p in $V $CV; do
    kld+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    kld+=" -X $p.gitTreeState=clean -X $p.gitCommit=$zero -X $p.buildDate=1970-01-01T00:00:00Z"
done
# One wrapper module (tools/k8s) holds Kubernetes, helm and scheduler-plugins, so they share one
# version of each common dependency and the packages they share are compiled once.
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    build k8s "$kld" "k8s.io/kubernetes/cmd/$b" "$b"
done
# helm's offline default Kubernetes version (helm template, helm lint) follows the cluster's.
hld="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION"
hld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    hld+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
done
build k8s "$hld" helm.sh/helm/v3/cmd/helm helm
# scheduler-plugins' scheduler (its coscheduling plugin places a PodGroup's pods together) and
# its PodGroup CRD, for the gang-scheduling tests (tests/e2e/test_gang.py).
build k8s "$kld" sigs.k8s.io/scheduler-plugins/cmd/scheduler kube-scheduler-plugins
plugins_dir=$(module_dir k8s sigs.k8s.io/scheduler-plugins)
cp "$plugins_dir/manifests/coscheduling/crd.yaml" "$tmp/podgroup-crd.yaml"
build etcd "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=v$ETCD_VERSION" \
    go.etcd.io/etcd/server/v3 etcd
# Kueue's manager and its CRDs, for the tests of its pod integration (tests/e2e/test_kueue.py).
build kueue "-s -w" sigs.k8s.io/kueue/cmd/kueue kueue
kueue_dir=$(module_dir kueue sigs.k8s.io/kueue)
mkdir -p "$tmp/kueue-crds"
cp "$kueue_dir"/config/components/crd/bases/*.yaml "$tmp/kueue-crds/"

# (Outputs are captured first: `cmd | grep -q` can fail under pipefail when grep exits early.)
check_version() {  # check_version <expected substring> <command...>
    local want=$1 got; shift
    got=$("$@" 2>&1) || fail "$* failed: $got"
    [[ $got == *"$want"* ]] || fail "$* reports '$got', expected $want"
}
check_version "v$K8S_VERSION" "$tmp/kube-apiserver" --version
check_version "v$K8S_VERSION" "$tmp/kubectl" version --client
check_version "$ETCD_VERSION" "$tmp/etcd" --version
check_version "v$HELM_VERSION" "$tmp/helm" version --short
{
    echo "built_at=$(date -u +%FT%TZ)"
    echo "build_seconds=$(( $(date +%s) - start ))"
    echo "go=$("$go" env GOVERSION)"
    du -b "$tmp"/* | awk '{printf "size_bytes %s %s\n", $2, $1}' | sed "s#$tmp/##"
} >"$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
# Builds for other keys (older flags, versions or modules) are superseded; each is ~420 MB.
for old in "$cache/bin"/k8s-v*; do
    [ "$old" = "$out" ] || { log "removing superseded $old"; rm -rf "$old"; }
done
log "done in $(( $(date +%s) - start )) s: $out"
}

# One line: bash has read the exit before main runs, however this file changes meanwhile.
main "$@"; exit $?
