#!/usr/bin/env bash
# Builds the external binaries the tests run (etcd, kube-apiserver, helm, and
# on request the real node's kubelet, kube-controller-manager,
# kube-scheduler, kubectl, crictl, containerd, runc, the reference CNI plugins,
# the Multus thin plugin and flanneld) from the Go module
# proxy, and the real node's Debian base image rootfs from the Debian
# packages, into a cache outside the repository keyed by version:
#
#   ${AMBIENT_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ambient-cni/tools}/<name>-<version>/<name>
#
# Each binary comes from its own tools module under hack/tools/ (committed
# go.mod and go.sum, so builds are reproducible); versions are read from those
# go.mod files, so bumping a version is a go.mod edit. cni-plugins is a
# directory (bridge, host-local, loopback) built from the project's own
# module at the version its go.mod requires. istiod-MINOR (pilot-discovery,
# the CRDs of Istio's base chart and istiod's chart) and istio-cni-MINOR
# (install-cni, the istio-cni plugin and Istio's istio-cni chart) are
# directories built from Istio's source, one pair per minor in
# istio_minors: a released minor from the source archive of its tag
# (hack/tools/istio-MINOR/source names it and its sha256; the archive is
# looked up in $ISTIO_SOURCES if set, else in the shared/istio folder beside the
# repository: the module proxy does not serve istio.io/istio at release
# commits), built with the tag's own go.mod plus the few replacements
# hack/tools/istio-MINOR/go.mod adds (-modfile); "next" is istio.io/istio's
# master from the module proxy (hack/tools/istio-next). istiod and
# istio-cni name the default minor's (istio_default): make check runs
# that one. registry is the CNCF distribution
# registry (cmd/registry of github.com/distribution/distribution/v3, the
# version hack/tools/distribution requires). debian-rootfs is a tarball made
# by mmdebstrap (Debian package); its version is a hash of what it includes.
# image-rootfs-amd64 and image-rootfs-arm64, make image's Debian bases, are
# tarballs made the same way, with no emulator for the foreign one.
# promtool and prometheus (the server) come from one tools module.
# flannel is flanneld (kube subnet manager, vxlan and host-gw backends) from
# a small main of its own in hack/tools/flannel: flannel's main package does
# not build from the Go module proxy.
# runc is the one cgo build: it needs gcc, pkgconf and Debian's
# libseccomp-dev (make deps installs them) and links libseccomp
# dynamically, as Debian's own runc package does.
# Nothing else is downloaded. What is already in the cache is not rebuilt.
# The Kubernetes binaries missing from the cache build in one go build (one
# compile DAG), as do promtool and prometheus. While anything builds, a
# line every 30 s says how many tools are built, each build's elapsed and
# expected time (its last build's, recorded in the cache as .seconds, else
# a table of cold builds on 2 cores) and about how many minutes are left.
#
# usage: hack/kube-tools.sh [name...]   build (default: etcd kube-apiserver helm promtool)
#        hack/kube-tools.sh node [name...] build everything the real node needs (and more)
#        hack/kube-tools.sh all         build every tool
#        hack/kube-tools.sh --path name print the cached binary's path
#        hack/kube-tools.sh --list      print name, version, path and state of each
#        hack/kube-tools.sh --istio-minors  print Istio's minors here, the default first
#        hack/kube-tools.sh --istio-src minor  print the source tree of that minor's Istio
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$repo/hack/tools"
cache="${AMBIENT_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ambient-cni/tools}"
GO="${GO:-go}"
default_tools=(etcd kube-apiserver helm promtool)
# Istio's builds the tests can run (AMBIENT_ISTIO=MINOR; make e2e-matrix
# runs each), and the one istiod and istio-cni stand for: the newest
# released minor, which make check runs.
istio_minors=(1.30 1.29 1.31 next)
istio_default=1.30
# The real node runs the agent's image make image builds: its base for
# this machine's architecture.
node_tools=(etcd kube-apiserver helm kubelet kube-controller-manager kube-scheduler kubectl crictl containerd runc cni-plugins multus debian-rootfs "istiod-$istio_default" prometheus registry flannel "image-rootfs-$("$GO" env GOARCH)")
# all_tools' order is the order tools build in (and their locks are
# taken in): make check starts the e2e with the node's tools, and each
# real-node test waits for what it needs, so they build in the order the
# tests first need them: every node (the Kubernetes binaries, containerd,
# the CNI plugins, the image bases, the registry), then the Prometheus
# server (TestRealNodeAlerts, the first), istiod, Istio's istio-cni (the
# switch, and make test's bench: right after istiod, whose build leaves it
# most of their common packages compiled), Multus (the layouts), flannel
# (the cluster) and runc (user namespaces, the last).
# The other minors' Istio builds come last: only make e2e-matrix runs them.
all_tools=(etcd kube-apiserver kubelet kube-controller-manager kube-scheduler kubectl helm crictl containerd cni-plugins debian-rootfs image-rootfs-amd64 image-rootfs-arm64 registry promtool prometheus "istiod-$istio_default" "istio-cni-$istio_default" multus flannel runc)
for m in "${istio_minors[@]}"; do
	[[ "$m" == "$istio_default" ]] || all_tools+=("istiod-$m" "istio-cni-$m")
done

# resolve NAME prints the tool NAME stands for: istiod and istio-cni are
# the default minor's.
resolve() {
	case "$1" in
	istiod | istio-cni) echo "$1-$istio_default" ;;
	*) echo "$1" ;;
	esac
}

# The DaemonSet image's base, as deploy/Dockerfile's: Debian bookworm with
# the netfilter tools, without documentation. Changing this list changes
# the rootfs version (its cache key).
rootfs_suite=bookworm
rootfs_args=(--variant=apt --include=iptables,nftables,ipset
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*'
	--dpkgopt='path-exclude=/usr/share/locale/*')

# The base of make image, one per architecture, both made the same way so
# that the two images carry the same files: --variant=extract unpacks the
# packages without running their maintainer scripts, so a foreign
# architecture needs no emulator (qemu-user and binfmt_misc). The
# Essential:yes set (?essential, what bookworm-slim holds but apt) and the
# netfilter tools, merged /usr as bookworm's, without documentation. The
# hook does what the unrun scripts would have done that matters here:
# /etc/passwd and /etc/group from base-passwd, /bin/sh (dash), and the iptables
# alternatives pointing at the nft flavour (bookworm's default; the agent
# itself names iptables-nft-* or iptables-legacy-* as the node uses), and
# dpkg's status: unpacked without dpkg, the packages would be in no
# database, so the hook lists each one installed with its control fields,
# for the release's SBOM (hack/release) and any image scanner.
image_rootfs_args=(--variant=extract --include='?essential' --include=usr-is-merged,iptables,nftables,ipset
	--setup-hook=/usr/share/mmdebstrap/hooks/merged-usr/setup00.sh
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*'
	--dpkgopt='path-exclude=/usr/share/locale/*')
image_rootfs_hook='set -e; r="$1"
for f in passwd group; do cp "$r/usr/share/base-passwd/$f.master" "$r/etc/$f"; done
[ -e "$r/usr/bin/sh" ] || ln -s dash "$r/usr/bin/sh"
mkdir -p "$r/etc/alternatives"
for t in iptables ip6tables arptables ebtables; do for s in "" -restore -save; do
	if [ -L "$r/usr/sbin/$t-nft$s" ]; then
		ln -sfn "/usr/sbin/$t-nft$s" "$r/etc/alternatives/$t$s"
		ln -sfn "/etc/alternatives/$t$s" "$r/usr/sbin/$t$s"
	fi
done; done
st="$r/var/lib/dpkg/status"
mkdir -p "${st%/*}"; touch "$st"
for d in $(printf "%s\n" $MMDEBSTRAP_ESSENTIAL | sort); do
	p="$(dpkg-deb -f "$r/$d" Package)"
	if grep -qx "Package: $p" "$st"; then continue; fi
	{ echo; echo "Package: $p"; echo "Status: install ok installed"; dpkg-deb -f "$r/$d" | grep -v "^Package:"; } >>"$st"
done'

# spec NAME prints: tools-module-dir version-module package
spec() {
	case "$1" in
	etcd) echo "etcd go.etcd.io/etcd/server/v3 ." ;;
	kube-apiserver) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-apiserver" ;;
	kubelet) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kubelet" ;;
	kube-controller-manager) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-controller-manager" ;;
	kube-scheduler) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kube-scheduler" ;;
	# The real kubectl, to run the project's kubectl plugin as operators do.
	kubectl) echo "kubernetes k8s.io/kubernetes k8s.io/kubernetes/cmd/kubectl" ;;
	helm) echo "helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm" ;;
	crictl) echo "cri-tools sigs.k8s.io/cri-tools sigs.k8s.io/cri-tools/cmd/crictl" ;;
	# A directory: containerd 2.x, its runc shim and ctr (the real node's
	# runtime; Debian's containerd is 1.6, which Kubernetes >= 1.36 drops).
	containerd) echo "containerd github.com/containerd/containerd/v2 github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr" ;;
	# The OCI runtime under containerd 2.x: a recent runc makes the
	# idmapped mounts user-namespaced pods need (Debian's 1.1.5 ignores
	# a mount's id mappings).
	runc) echo "runc github.com/opencontainers/runc github.com/opencontainers/runc" ;;
	# The thin plugin: Multus as the node's primary meta-plugin, reading
	# its delegates' configs itself (no multus daemon).
	multus) echo "multus gopkg.in/k8snetworkplumbingwg/multus-cni.v4 gopkg.in/k8snetworkplumbingwg/multus-cni.v4/cmd/multus" ;;
	# The real primary between several real nodes: the tools module's own
	# main over flannel's packages.
	flannel) echo "flannel github.com/flannel-io/flannel ." ;;
	# "@": built inside the plugins' own module (its go.sum pins their
	# dependencies) at the version the project's go.mod requires.
	cni-plugins) echo "@ github.com/containernetworking/plugins ./plugins/main/bridge ./plugins/ipam/host-local ./plugins/main/loopback" ;;
	# Directories, one pair per minor: istiod-MINOR holds pilot-discovery,
	# crd-all.gen.yaml (the CRDs of Istio's base chart) and istiod's chart
	# istio-discovery; istio-cni-MINOR holds install-cni, the istio-cni
	# plugin and Istio's istio-cni chart (chart/); each chart copied from
	# the source the binaries are built from.
	istiod-* | istio-cni-*)
		local m="${1#istiod-}"
		m="${m#istio-cni-}"
		if [[ ! " ${istio_minors[*]} " =~ " $m " ]]; then
			echo "unknown tool $1: Istio's minors here are ${istio_minors[*]}" >&2
			return 1
		fi
		case "$1" in
		istiod-*) echo "istio-$m istio.io/istio istio.io/istio/pilot/cmd/pilot-discovery" ;;
		*) echo "istio-$m istio.io/istio istio.io/istio/cni/cmd/install-cni istio.io/istio/cni/cmd/istio-cni" ;;
		esac
		;;
	# promtool runs the alert rules' unit tests (make test); the server
	# scrapes the agent on the real node (make e2e). Both from one
	# module, without service discovery (remove_all_sd) or UI assets.
	promtool) echo "prometheus github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/promtool" ;;
	prometheus) echo "prometheus github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/prometheus" ;;
	# The CNCF distribution registry: the real node's OCI registry on
	# loopback, which the agent's image and chart are pushed to and
	# pulled from.
	registry) echo "distribution github.com/distribution/distribution/v3 github.com/distribution/distribution/v3/cmd/registry" ;;
	debian-rootfs) echo "- - -" ;;
	image-rootfs-amd64 | image-rootfs-arm64) echo "rootfs:${1#image-rootfs-} - -" ;;
	*)
		echo "unknown tool $1 (known: ${all_tools[*]})" >&2
		return 1
		;;
	esac
}

# moddir MODDIR [MODULE VERSION] is the directory of a tools module, for
# "@" the downloaded source of MODULE at VERSION, and for a released
# Istio's the source tree of its tag (istio_tree).
moddir() {
	if [[ "$1" == @ ]]; then
		(cd "$repo" && "$GO" mod download -json "$2@$3" | awk -F'"' '$2 == "Dir" { print $4 }')
	elif [[ -f "$tools/$1/source" ]]; then
		istio_tree "$1"
	else
		echo "$tools/$1"
	fi
}

# modfile MODDIR prints the go flag a build in moddir's directory takes: a
# released Istio's tree builds with the go.mod (and go.sum) beside its
# source file, the tag's own plus replacements, and is left as unpacked.
modfile() {
	[[ ! -f "$tools/$1/source" ]] || echo "-modfile=$tools/$1/go.mod"
}

# source_field MODDIR KEY reads KEY=value from hack/tools/MODDIR/source.
source_field() {
	awk -F= -v k="$2" '$1 == k { print $2; exit }' "$tools/$1/source"
}

# istio_tree MODDIR prints the unpacked source tree of the released Istio
# hack/tools/MODDIR/source names (tag, commit, archive, sha256), unpacking
# its archive into the cache once: from the folder $ISTIO_SOURCES names,
# else the shared/istio folder beside the repository, checked against the
# sha256.
istio_tree() {
	local tag archive sum d f="" lock got tmp
	tag="$(source_field "$1" tag)"
	archive="$(source_field "$1" archive)"
	sum="$(source_field "$1" sha256)"
	d="$cache/.src/istio-$tag-${sum:0:12}"
	if [[ -f "$d/go.mod" ]]; then
		echo "$d"
		return 0
	fi
	f="${ISTIO_SOURCES:-$repo/../shared/istio}/$archive"
	if [[ ! -f "$f" ]]; then
		echo "kube-tools: Istio $tag's source archive $archive is not in ${ISTIO_SOURCES:-the shared/istio folder beside the repository} ($(dirname "$f")); set ISTIO_SOURCES to a folder holding it (git archive of istio/istio's tag $tag, xz-compressed, sha256 $sum)" >&2
		return 1
	fi
	got="$(sha256sum "$f" | cut -d' ' -f1)"
	if [[ "$got" != "$sum" ]]; then
		echo "kube-tools: $f has sha256 $got, want $sum (hack/tools/$1/source)" >&2
		return 1
	fi
	mkdir -p "$cache/.src"
	exec {lock}>"$d.lock"
	if command -v flock >/dev/null; then
		flock "$lock"
	fi
	if [[ ! -f "$d/go.mod" ]]; then
		tmp="$d.tmp.$$"
		rm -rf "$tmp"
		mkdir -p "$tmp"
		if ! tar -xJf "$f" -C "$tmp"; then
			rm -rf "$tmp"
			exec {lock}>&-
			echo "kube-tools: cannot unpack $f" >&2
			return 1
		fi
		mv -fT "$tmp" "$d"
	fi
	exec {lock}>&-
	echo "$d"
}

# version MODDIR MODULE reads MODULE's required version from the tools go.mod.
# The rootfs (MODDIR "-") is versioned by its suite and a hash of its
# mmdebstrap arguments.
version() {
	local v
	if [[ -f "$tools/$1/source" ]]; then
		source_field "$1" tag
		return 0
	fi
	if [[ "$1" == - ]]; then
		v="$(printf '%s\n' "$rootfs_suite" "${rootfs_args[@]}" | sha256sum)"
		echo "$rootfs_suite-${v:0:12}"
		return 0
	fi
	if [[ "$1" == rootfs:* ]]; then
		v="$(printf '%s\n' "$rootfs_suite" "${1#rootfs:}" "${image_rootfs_args[@]}" "$image_rootfs_hook" | sha256sum)"
		echo "$rootfs_suite-${v:0:12}"
		return 0
	fi
	local gomod="$tools/$1/go.mod"
	[[ "$1" == @ ]] && gomod="$repo/go.mod"
	v="$(awk -v m="$2" '($1 == "require" && $2 == m) { print $3; exit } ($1 == m && $2 ~ /^v/) { print $2; exit }' "$gomod")"
	if [[ -z "$v" ]]; then
		echo "cannot find $2 in $gomod" >&2
		return 1
	fi
	echo "$v"
}

# ldflags NAME VERSION stamps versions the way the upstream release builds do
# (without them kube-apiserver reports v0.0.0 and helm assumes Kubernetes 1.20).
ldflags() {
	local v="$2"
	case "$1" in
	kube-apiserver | kubelet | kube-controller-manager | kube-scheduler | kubectl)
		# Both version packages, for every binary, as Kubernetes' own
		# release build stamps them (kubectl version reports client-go's):
		# the binaries of one go build share one set of flags.
		local minor="${v#v1.}" p
		minor="${minor%%.*}"
		for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
			printf -- '-X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean ' "$p" "$v" "$p" "$p" "$minor" "$p"
		done
		echo
		;;
	helm)
		local kv
		kv="$(version helm k8s.io/client-go)" # v0.<minor>.<patch>
		kv="${kv#v0.}"
		echo "-X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${kv%%.*} -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=${kv%%.*}"
		;;
	crictl)
		echo "-X sigs.k8s.io/cri-tools/pkg/version.Version=$v"
		;;
	promtool | prometheus)
		# The module's v0.3MM.P is Prometheus 3.MM.P.
		local pv="${v#v0.3}"
		pv="3.$((10#${pv%%.*})).${pv#*.}"
		echo "-X github.com/prometheus/common/version.Version=$pv -X github.com/prometheus/common/version.Branch=HEAD"
		;;
	registry)
		echo "-X github.com/distribution/distribution/v3/version.version=$v -X github.com/distribution/distribution/v3/version.mainpkg=github.com/distribution/distribution/v3"
		;;
	runc)
		# The VERSION file is embedded; the commit line names the tag.
		echo "-X main.gitCommit=$v"
		;;
	containerd)
		echo "-X github.com/containerd/containerd/v2/version.Version=$v -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
		;;
	multus)
		echo "-X gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/multus.version=$v -X gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/multus.gitTreeState=clean -X gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/multus.releaseStatus=,released"
		;;
	istiod-* | istio-cni-*)
		local dir src iv rev
		read -r dir _ <<<"$(spec "$1")"
		if [[ -f "$tools/$dir/source" ]]; then
			# As Istio's release build stamps a tag.
			iv=$v
			rev="$(source_field "$dir" commit)"
		else
			# As Istio's Makefile stamps a build of its branch: VERSION
			# file plus -dev, and the commit of the pseudo-version.
			src="$(istio_src "$dir" "$v")" || return 1
			iv="$(tr -d '[:space:]' <"$src/VERSION")-dev"
			rev=${v##*-}
		fi
		echo "-X istio.io/istio/pkg/version.buildVersion=$iv -X istio.io/istio/pkg/version.buildGitRevision=$rev -X istio.io/istio/pkg/version.buildStatus=Clean -X istio.io/istio/pkg/version.buildTag=$v"
		;;
	esac
}

# buildtags NAME are the tags Istio's Makefile builds a binary with
# (STANDARD_TAGS for istiod, AGENT_TAGS for the node agents).
buildtags() {
	case "$1" in
	istiod-*) echo "vtprotobuf,disable_pgv" ;;
	istio-cni-*) echo "agent,disable_pgv,grpcnotrace,retrynotrace" ;;
	# As containerd's static release builds: no snapshotters this host
	# lacks (btrfs, devmapper and zfs need cgo or kernel headers).
	containerd) echo "no_btrfs,no_devmapper,no_zfs" ;;
	# As runc's Makefile, without libpathrs (a Rust library).
	runc) echo "seccomp,urfave_cli_no_docs" ;;
	# Only static configurations are scraped: no service discovery
	# plugins (promtool still links Kubernetes SD, which it imports
	# itself). Without builtinassets the server has no web UI; its HTTP
	# API is all the tests use.
	promtool | prometheus) echo "remove_all_sd" ;;
	esac
}

# istio_src MODDIR VERSION is the source of Istio that MODDIR builds (for
# its VERSION file and its charts): a released minor's unpacked tree, or
# next's istio.io/istio from the module cache.
istio_src() {
	if [[ -f "$tools/$1/source" ]]; then
		istio_tree "$1"
	else
		(cd "$tools/$1" && "$GO" mod download -json "istio.io/istio@$2" | awk -F'"' '$2 == "Dir" { print $4 }')
	fi
}

# finish NAME VERSION TMP adds what a tool directory holds beside its
# binaries.
finish() {
	local dir src
	case "$1" in
	istiod-*)
		# The CRDs of Istio's base chart, and istiod's own chart, whose
		# rendering says how istiod runs (environment, RBAC, mesh config).
		read -r dir _ <<<"$(spec "$1")"
		src="$(istio_src "$dir" "$2")" || return 1
		install -m 0644 "$src/manifests/charts/base/files/crd-all.gen.yaml" "$3/crd-all.gen.yaml" &&
			cp -R "$src/manifests/charts/istio-control/istio-discovery" "$3/istio-discovery" &&
			chmod -R u+w "$3/istio-discovery"
		;;
	istio-cni-*)
		# Istio's istio-cni chart of the same source, as chart/.
		read -r dir _ <<<"$(spec "$1")"
		src="$(istio_src "$dir" "$2")" || return 1
		cp -R "$src/manifests/charts/istio-cni" "$3/chart" && chmod -R u+w "$3/chart"
		;;
	esac
}

binpath() {
	local s dir mod
	s="$(spec "$1")" || return 1
	read -r dir mod _ <<<"$s"
	echo "$cache/$1-$(version "$dir" "$mod")/$1"
}

# group NAME names the tools built by one go build with NAME when several
# of them are missing: one compile DAG keeps both cores busy to the end and
# links beside compiles, where one go build per binary idles through each
# link and each DAG's narrow tail. Members share a tools module, tags and
# ldflags, and each package's last element is the binary's name.
# It sets REPLY (no subshell: a warm run asks it of every tool).
group() {
	case "$1" in
	kube-apiserver | kubelet | kube-controller-manager | kube-scheduler | kubectl) REPLY=kubernetes ;;
	promtool | prometheus) REPLY=prometheus ;;
	*) REPLY=$1 ;;
	esac
}

# versions holds version's answers by "MODDIR MODULE": build_all asks each
# once, build reuses them.
declare -A versions=()

# expect NAME prints the seconds a cold build of NAME took on a quiet
# 2-core machine (empty Go build cache, module downloads included, after
# the tools before it in make check's order: hack/README.md): the
# estimate when the cache records no earlier build of NAME.
expect() {
	case "$1" in
	etcd) echo 80 ;;
	kube-apiserver) echo 380 ;;
	kubelet) echo 120 ;;
	kube-controller-manager) echo 50 ;;
	kube-scheduler) echo 15 ;;
	kubectl) echo 40 ;;
	helm) echo 95 ;;
	crictl) echo 50 ;;
	containerd) echo 90 ;;
	runc) echo 60 ;;
	cni-plugins) echo 10 ;;
	multus) echo 75 ;;
	flannel) echo 150 ;;
	debian-rootfs) echo 40 ;;
	istio-cni-*) echo 170 ;;
	istiod-*) echo 200 ;;
	image-rootfs-*) echo 60 ;;
	promtool) echo 150 ;;
	prometheus) echo 60 ;;
	registry) echo 120 ;;
	*) echo 60 ;;
	esac
}

# estimate NAME prints the seconds NAME's build should take: what its
# newest build (of any version) recorded in the cache, else expect's.
estimate() {
	local f newest="" s
	for f in "$cache/$1"-*/.seconds; do
		[[ -f "$f" && "${f%/.seconds}" == "$cache/$1-"* ]] || continue
		[[ -n "$newest" && ! "$f" -nt "$newest" ]] || newest=$f
	done
	if [[ -n "$newest" ]] && read -r s <"$newest" && [[ "$s" =~ ^[0-9]+$ ]]; then
		echo "$s"
	else
		expect "$1"
	fi
}

# mmss SECONDS prints M:SS.
mmss() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }

# Progress: build_all writes its plan into the directory $progress, one
# line per build ("QUEUE SECONDS NAME..."), and build marks each start
# (start.FIRSTNAME, the epoch second) and each tool done (done.NAME).
progress=""

mark() { # mark start|done NAME, whole or not at all (report reads it)
	[[ -z "$progress" ]] || { date +%s >"$progress/.$1.$2" && mv -f "$progress/.$1.$2" "$progress/$1.$2"; }
}

# report prints one line: how many tools are built, each build under way
# with its elapsed and expected time, and the time left. The Go tools build
# one after another, the Debian bases beside them: the time left is the
# longer of the two queues.
report() {
	local now q e names first n all=0 built=0 el rem line="" left
	local -A queue=()
	now=$(date +%s)
	while read -r q e names; do
		first=${names%% *}
		for n in $names; do
			all=$((all + 1))
			[[ ! -e "$progress/done.$n" ]] || built=$((built + 1))
		done
		[[ ! -e "$progress/done.${names##* }" ]] || continue
		rem=$e
		if [[ -e "$progress/start.$first" ]]; then
			el=$((now - $(<"$progress/start.$first")))
			rem=$((e > el ? e - el : 0))
			line+="; building ${names// /+} $(mmss "$el") of about $(mmss "$e")"
		fi
		queue[$q]=$((${queue[$q]:-0} + rem))
	done <"$progress/plan"
	left=0
	for q in "${!queue[@]}"; do ((queue[$q] <= left)) || left=${queue[$q]}; done
	if ((left > 0)); then
		left="about $(((left + 59) / 60)) min left"
	else
		left="past the estimate"
	fi
	echo "kube-tools: $built of $all tools built, $left$line"
}

# heartbeat prints report every 30 s (KUBE_TOOLS_HEARTBEAT) until killed:
# go build and mmdebstrap's download are silent for minutes on a cold cache.
# The sleep holds none of the script's output: killing heartbeat leaves it
# to end alone, and a reader of that output (make, a test) would otherwise
# wait for it up to 30 s after the script has ended.
heartbeat() {
	while sleep "${KUBE_TOOLS_HEARTBEAT:-30}" >/dev/null 2>&1; do report || true; done
}

# compile NAME VERSION SRCDIR TMP PKG... runs go build; TMP is the binary,
# or a directory for a tool of several binaries.
compile() {
	local name="$1" v="$2" src="$3" tmp="$4"
	shift 4
	local out="$tmp" flags
	if [[ $# -gt 1 || "$name" == istiod-* ]]; then
		mkdir -p "$tmp"
		out="$tmp/"
	fi
	flags="$(ldflags "$name" "$v")" || return 1
	local cgo=0
	# runc's nsenter is C, and seccomp goes through libseccomp.
	[[ "$name" == runc ]] && cgo=1
	local dir mf
	read -r dir _ <<<"$(spec "$name")"
	mf="$(modfile "$dir")"
	(cd "$src" && CGO_ENABLED=$cgo "$GO" build -mod=readonly ${mf:+"$mf"} -trimpath -tags "$(buildtags "$name")" -ldflags "-s -w $flags" -o "$out" "$@") &&
		finish "$name" "$v" "$tmp"
}

# rootfs TMP builds the image base with mmdebstrap (Debian package
# mmdebstrap; as root it needs no daemon and no registry).
rootfs() {
	if ! command -v mmdebstrap >/dev/null; then
		echo "kube-tools: debian-rootfs needs mmdebstrap (Debian package mmdebstrap; make deps installs it)" >&2
		return 1
	fi
	mmdebstrap --quiet --format=tar "${rootfs_args[@]}" "$rootfs_suite" "$1"
}

# image_rootfs ARCH TMP builds make image's base for ARCH (see
# image_rootfs_args); SOURCE_DATE_EPOCH pins the times mmdebstrap sets.
image_rootfs() {
	if ! command -v mmdebstrap >/dev/null; then
		echo "kube-tools: image-rootfs needs mmdebstrap (Debian package mmdebstrap; make deps installs it)" >&2
		return 1
	fi
	SOURCE_DATE_EPOCH=0 mmdebstrap --quiet --format=tar --architectures="$1" "${image_rootfs_args[@]}" \
		--extract-hook="$image_rootfs_hook" "$rootfs_suite" "$2"
}

# build NAME... builds one tool, or several of one group (see group) in one
# go build. A tool the cache holds is not rebuilt. Each tool's directory
# has a lock, one builder at a time: a second caller waits, then finds it
# cached. Locks are taken in all_tools' order (build_all's), so two
# builders of overlapping groups never wait on each other in a circle.
build() {
	local s dir mod pkgs v n out lock start rc tmp src="" secs total=0
	local -a names=() outs=() locks=() pkg=()
	s="$(spec "$1")"
	read -r dir mod pkgs <<<"$s"
	v=${versions["$dir $mod"]:-}
	[[ -n "$v" ]] || v="$(version "$dir" "$mod")"
	for n in "$@"; do
		out="$cache/$n-$v/$n"
		if [[ -e "$out" ]]; then
			echo "kube-tools: $n $v cached at $out"
			mark done "$n"
			continue
		fi
		mkdir -p "$(dirname "$out")"
		exec {lock}>"$(dirname "$out")/.lock"
		if command -v flock >/dev/null; then
			flock "$lock"
		fi
		if [[ -e "$out" ]]; then
			echo "kube-tools: $n $v cached at $out (built by another process)"
			exec {lock}>&-
			mark done "$n"
			continue
		fi
		names+=("$n")
		outs+=("$out")
		locks+=("$lock")
		if [[ $# -gt 1 ]]; then
			pkg+=("$(spec "$n" | cut -d' ' -f3)")
		fi
	done
	[[ ${#names[@]} -gt 0 ]] || return 0
	[[ $# -gt 1 ]] || read -r -a pkg <<<"$pkgs"
	mark start "${names[0]}"
	start=$SECONDS
	tmp="$(dirname "${outs[0]}")/.${names[0]}.tmp.$$"
	rm -rf "$tmp"
	for n in "${names[@]}"; do total=$((total + $(expect "$n"))); done
	secs=0
	for n in "${names[@]}"; do secs=$((secs + $(estimate "$n"))); done
	if [[ "$dir" != - && "$dir" != rootfs:* ]]; then
		echo "kube-tools: downloading modules for ${names[*]} $v ..."
		src="$(moddir "$dir" "$mod" "$v")"
		if [[ -z "$src" ]]; then
			echo "kube-tools: cannot download $mod $v" >&2
			for lock in "${locks[@]}"; do exec {lock}>&-; done
			return 1
		fi
		# go list fetches exactly the modules the build needs, so the silent
		# compile that follows is split from the network part.
		local mf
		mf="$(modfile "$dir")"
		(cd "$src" && "$GO" list -mod=readonly ${mf:+"$mf"} -tags "$(buildtags "${names[0]}")" -deps "${pkg[@]}" >/dev/null)
		local how=""
		[[ ${#names[@]} -eq 1 ]] || how=" in one go build"
		echo "kube-tools: building ${names[*]} $v$how (about $(mmss "$secs") on 2 cores) ..."
	else
		echo "kube-tools: building ${names[0]} $v with mmdebstrap from the Debian packages (about $(mmss "$secs")) ..."
	fi
	rc=0
	if [[ "$dir" == - ]]; then
		rootfs "$tmp" || rc=$?
	elif [[ "$dir" == rootfs:* ]]; then
		image_rootfs "${dir#rootfs:}" "$tmp" || rc=$?
	elif [[ $# -gt 1 ]]; then
		# A group's go build writes each binary under its package's name.
		mkdir -p "$tmp"
		compile "${names[0]}" "$v" "$src" "$tmp/" "${pkg[@]}" || rc=$?
	else
		compile "${names[0]}" "$v" "$src" "$tmp" "${pkg[@]}" || rc=$?
	fi
	if [[ $rc -ne 0 ]]; then
		rm -rf "$tmp"
		for lock in "${locks[@]}"; do exec {lock}>&-; done
		echo "kube-tools: building ${names[*]} $v failed" >&2
		return "$rc"
	fi
	secs=$((SECONDS - start))
	for n in "${!names[@]}"; do
		if [[ $# -gt 1 ]]; then
			mv -fT "$tmp/${names[$n]}" "${outs[$n]}"
		else
			mv -fT "$tmp" "${outs[$n]}"
		fi
		# The next build's estimate: a group's time shared as expect's
		# figures share it.
		echo $((secs * $(expect "${names[$n]}") / total)) >"$(dirname "${outs[$n]}")/.seconds"
		lock=${locks[$n]}
		exec {lock}>&-
		mark done "${names[$n]}"
		echo "kube-tools: built ${names[$n]} $v in $secs s -> ${outs[$n]}"
	done
	rm -rf "$tmp"
}

# prefetch NAME... downloads, one tool after another, the modules each Go
# tool's build needs (go list -deps, as build does), so that the network
# part of the next build happens while the current one compiles. Only the
# module cache is touched (it takes its own locks); build repeats the step
# and finds everything there.
prefetch() {
	local n s dir mod pkgs v src mf
	for n in "$@"; do
		s="$(spec "$n")" || continue
		read -r dir mod pkgs <<<"$s"
		[[ "$dir" == - || "$dir" == rootfs:* ]] && continue
		v="$(version "$dir" "$mod")" || continue
		[[ -e "$cache/$n-$v/$n" ]] && continue
		src="$(moddir "$dir" "$mod" "$v" 2>/dev/null)" || continue
		[[ -n "$src" ]] || continue
		mf="$(modfile "$dir")"
		# shellcheck disable=SC2086 # pkgs is a list of packages
		(cd "$src" && "$GO" list -mod=readonly ${mf:+"$mf"} -tags "$(buildtags "$n")" -deps $pkgs >/dev/null 2>&1) || true
	done
}

# build_all NAME... builds the tools named. The Go tools build one group
# at a time (go build already uses every core, and one after another they
# share the build cache), with the next ones' modules downloaded meanwhile;
# the Debian bases, which wait on the network and dpkg rather than the CPU,
# build beside them. A cold make check thus overlaps most of its
# downloads with compiling. While anything builds, heartbeat reports.
build_all() {
	local -a units=() gotools=() rootfses=()
	local -A unit_of=()
	local n t g u rc=0 fetcher="" baser="" beat="" q secs missing dir mod
	# Units in all_tools' order (the lock order), a group's members
	# together.
	for t in "${all_tools[@]}"; do
		for n in "$@"; do
			[[ "$n" == "$t" ]] || continue
			group "$n"
			g=$REPLY
			if [[ -n "${unit_of[$g]:-}" ]]; then
				units[${unit_of[$g]}]+=" $n"
			else
				unit_of[$g]=${#units[@]}
				units+=("$n")
			fi
			break
		done
	done
	progress=$(mktemp -d)
	# The tools this run will build, under its pid, while it runs: a test
	# that finds one of them missing waits for it rather than failing
	# (test/lib/kubeenv; make check starts the e2e while the real node's
	# last tools still build).
	mkdir -p "$cache/.builders"
	printf '%s\n' "$@" >"$cache/.builders/$$"
	trap 'rm -rf "$progress" "$cache"/*/.*.tmp."$$" "$cache/.builders/$$"' EXIT
	trap 'exit 143' TERM
	trap 'exit 130' INT
	: >"$progress/plan"
	for u in "${units[@]}"; do
		case "$u" in
		debian-rootfs | image-rootfs-*) rootfses+=("$u") q=deb ;;
		*) gotools+=("$u") q=go ;;
		esac
		missing="" secs=0
		read -r dir mod _ <<<"$(spec "${u%% *}")"
		[[ -n "${versions["$dir $mod"]:-}" ]] || versions["$dir $mod"]=$(version "$dir" "$mod")
		for n in $u; do
			[[ ! -e "$cache/$n-${versions["$dir $mod"]}/$n" ]] || continue
			missing+=" $n"
			secs=$((secs + $(estimate "$n")))
		done
		[[ -z "$missing" ]] || echo "$q $secs$missing" >>"$progress/plan"
	done
	if [[ -s "$progress/plan" ]]; then
		heartbeat &
		beat=$!
	fi
	if [[ ${#rootfses[@]} -gt 0 && ${#gotools[@]} -gt 0 ]]; then
		(for n in "${rootfses[@]}"; do build "$n" || exit 1; done) &
		baser=$!
		rootfses=()
	fi
	if [[ ${#gotools[@]} -gt 1 ]]; then
		# shellcheck disable=SC2086 # units are lists of names
		prefetch ${gotools[*]:1} &
		fetcher=$!
	fi
	for u in "${gotools[@]}" "${rootfses[@]}"; do
		# shellcheck disable=SC2086 # a unit is a list of names
		build $u || {
			rc=1
			break
		}
	done
	if [[ $rc -ne 0 && -n "$beat" ]]; then
		# No more estimates once a build failed.
		kill "$beat" 2>/dev/null || true
		[[ -z "$baser" ]] || echo "kube-tools: waiting for the Debian bases building beside it"
	fi
	if [[ -n "$fetcher" ]]; then
		# Done long before the last build, unless a build failed: then
		# stop it (a go list it started finishes on its own).
		[[ $rc -eq 0 ]] || kill "$fetcher" 2>/dev/null || true
		wait "$fetcher" 2>/dev/null || true
	fi
	if [[ -n "$baser" ]]; then
		wait "$baser" || rc=1
	fi
	if [[ -n "$beat" ]]; then
		kill "$beat" 2>/dev/null || true
		wait "$beat" 2>/dev/null || true
	fi
	return "$rc"
}

case "${1:-}" in
--path)
	[[ $# -eq 2 ]] || {
		echo "usage: $0 --path name" >&2
		exit 2
	}
	binpath "$(resolve "$2")"
	;;
--istio-minors)
	# The default first.
	echo "$istio_default"
	for m in "${istio_minors[@]}"; do [[ "$m" == "$istio_default" ]] || echo "$m"; done
	;;
--istio-src)
	[[ $# -eq 2 && " ${istio_minors[*]} " =~ " $2 " ]] || {
		echo "usage: $0 --istio-src minor (one of: ${istio_minors[*]})" >&2
		exit 2
	}
	read -r dir mod _ <<<"$(spec "istiod-$2")"
	istio_src "$dir" "$(version "$dir" "$mod")"
	;;
--list)
	for n in "${all_tools[@]}"; do
		p="$(binpath "$n")"
		state=missing
		[[ -e "$p" ]] && state=built
		v="${p%/*}"
		v="${v##*/"$n"-}"
		printf '%-24s %-20s %-8s %s\n' "$n" "$v" "$state" "$p"
	done
	;;
-h | --help)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
	;;
*)
	if [[ $# -eq 0 ]]; then
		set -- "${default_tools[@]}"
	fi
	# node and all stand for their lists, beside other names too
	# (make check's node-tools: node istio-cni).
	args=()
	for n in "$@"; do
		case "$n" in
		node) args+=("${node_tools[@]}") ;;
		all) args+=("${all_tools[@]}") ;;
		*) args+=("$(resolve "$n")") ;;
		esac
	done
	set -- "${args[@]}"
	for n in "$@"; do
		spec "$n" >/dev/null
	done
	build_all "$@"
	;;
esac
