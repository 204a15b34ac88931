#!/usr/bin/env bash
# Builds the external binaries the tests run (etcd, kube-apiserver, helm, and
# on request kubelet) from the Go module proxy, into a cache outside the
# repository keyed by version:
#
#   ${AMBIENT_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ambient-cni/tools}/<name>-<version>/<name>
#
# Each binary comes from its own tools module under hack/tools/ (committed
# go.mod and go.sum, so builds are reproducible); versions are read from those
# go.mod files, so bumping a version is a go.mod edit. Nothing but Go modules
# is downloaded. A binary already in the cache is not rebuilt.
#
# usage: hack/kube-tools.sh [name...]   build (default: etcd kube-apiserver helm)
#        hack/kube-tools.sh --path name print the cached binary's path
#        hack/kube-tools.sh --list      print name, version, path and state of each
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$repo/hack/tools"
cache="${AMBIENT_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ambient-cni/tools}"
GO="${GO:-go}"
default_tools=(etcd kube-apiserver helm)
all_tools=(etcd kube-apiserver kubelet helm)

# spec NAME prints: tools-module-dir version-module package
spec() {
	case "$1" in
	etcd) echo "etcd go.etcd.io/etcd/server/v3 ." ;;
	kube-apiserver) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-apiserver" ;;
	kubelet) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kubelet" ;;
	helm) echo "helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm" ;;
	*)
		echo "unknown tool $1 (known: ${all_tools[*]})" >&2
		return 1
		;;
	esac
}

# version MODDIR MODULE reads MODULE's required version from the tools go.mod.
version() {
	local v
	v="$(awk -v m="$2" '($1 == "require" && $2 == m) { print $3; exit } ($1 == m && $2 ~ /^v/) { print $2; exit }' "$tools/$1/go.mod")"
	if [[ -z "$v" ]]; then
		echo "cannot find $2 in hack/tools/$1/go.mod" >&2
		return 1
	fi
	echo "$v"
}

# ldflags NAME VERSION stamps versions the way the upstream release builds do
# (without them kube-apiserver reports v0.0.0 and helm assumes Kubernetes 1.20).
ldflags() {
	local v="$2"
	case "$1" in
	kube-apiserver | kubelet)
		local minor="${v#v1.}"
		minor="${minor%%.*}"
		echo "-X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
		;;
	helm)
		local kv
		kv="$(version helm k8s.io/client-go)" # v0.<minor>.<patch>
		kv="${kv#v0.}"
		echo "-X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${kv%%.*} -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=${kv%%.*}"
		;;
	esac
}

binpath() {
	local s dir mod
	s="$(spec "$1")" || return 1
	read -r dir mod _ <<<"$s"
	echo "$cache/$1-$(version "$dir" "$mod")/$1"
}

build() {
	local name="$1" s dir mod pkg v out tmp start pid rc
	s="$(spec "$name")"
	read -r dir mod pkg <<<"$s"
	v="$(version "$dir" "$mod")"
	out="$cache/$name-$v/$name"
	if [[ -x "$out" ]]; then
		echo "kube-tools: $name $v cached at $out"
		return 0
	fi
	mkdir -p "$(dirname "$out")"
	# One builder per binary: a second caller waits, then finds it cached.
	exec {lock}>"$(dirname "$out")/.lock"
	if command -v flock >/dev/null; then
		flock "$lock"
	fi
	if [[ -x "$out" ]]; then
		echo "kube-tools: $name $v cached at $out (built by another process)"
		exec {lock}>&-
		return 0
	fi
	start=$SECONDS
	echo "kube-tools: downloading modules for $name $v ..."
	# go list fetches exactly the modules the build needs, so the silent
	# compile that follows is split from the network part.
	(cd "$tools/$dir" && "$GO" list -mod=readonly -deps "$pkg" >/dev/null)
	echo "kube-tools: building $name $v (a cold build takes minutes: etcd ~2, kube-apiserver ~5-10, helm ~1.5 on 2 cores) ..."
	tmp="$(dirname "$out")/.$name.tmp.$$"
	# Progress heartbeat: go build is silent until it finishes.
	(
		while sleep 30; do echo "kube-tools:   still building $name ($((SECONDS - start)) s)"; done
	) &
	pid=$!
	rc=0
	(cd "$tools/$dir" && CGO_ENABLED=0 "$GO" build -mod=readonly -trimpath -ldflags "-s -w $(ldflags "$name" "$v")" -o "$tmp" "$pkg") || rc=$?
	kill "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
	if [[ $rc -ne 0 ]]; then
		rm -f "$tmp"
		exec {lock}>&-
		echo "kube-tools: building $name $v failed" >&2
		return "$rc"
	fi
	mv -f "$tmp" "$out"
	exec {lock}>&-
	echo "kube-tools: built $name $v in $((SECONDS - start)) s -> $out"
}

case "${1:-}" in
--path)
	[[ $# -eq 2 ]] || {
		echo "usage: $0 --path name" >&2
		exit 2
	}
	binpath "$2"
	;;
--list)
	for n in "${all_tools[@]}"; do
		p="$(binpath "$n")"
		state=missing
		[[ -x "$p" ]] && state=built
		v="${p%/*}"
		v="${v##*/"$n"-}"
		printf '%-15s %-10s %-8s %s\n' "$n" "$v" "$state" "$p"
	done
	;;
-h | --help)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
	;;
*)
	if [[ $# -eq 0 ]]; then
		set -- "${default_tools[@]}"
	fi
	for n in "$@"; do
		spec "$n" >/dev/null
	done
	for n in "$@"; do
		build "$n"
	done
	;;
esac
