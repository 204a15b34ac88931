#!/bin/sh
# hack/deps.sh (make deps): install the Debian packages make check and
# make demo need, as root, with apt-get. When every one is installed it
# prints one line and changes nothing (no apt-get update), so make check
# and make demo run it first every time.
#
# usage: hack/deps.sh           install what is missing (root)
#        hack/deps.sh --list    print each package and why it is needed
#        hack/deps.sh --missing print the missing packages (any user; exit 1 if some)
#
# Debian bookworm and trixie are the tested releases; another Debian-like
# system with apt-get and dpkg is tried with a note. Go itself is not a
# Debian package here: the build wants the release go.mod names, from go.dev.
set -eu

# One package a line: the package, then why. "a|b" is satisfied by either
# (the first is installed when neither is).
deps='iptables            the iptables rules backend the agent drives and the tests read; kubelet and flannel on the real node
nftables            nft: the nftables rules backend and the rule checks of the tests
ipset               the sets of the iptables backend (and of istio-cni, for the switch from it)
iproute2            ip and ss: network namespaces, veths, routes, listening sockets in pods
conntrack           the connection tracking tool of a Kubernetes node (the real node runs kubelet and flannel here)
kmod                modprobe, which iptables runs to load netfilter modules
util-linux          nsenter and unshare: entering and making the namespaces of pods
mount               mount and umount: the namespaces of the real node worker, the volumes of kubelet
mawk|gawk           awk: hack/kube-tools.sh and the scripts of the real node
e2fsprogs           chattr: the tests that make the CNI config directory unwritable (immutable attribute)
ca-certificates     HTTPS to the Go module proxy, which the tools cache builds from
git                 git describe: the version make stamps into the binaries
make                make itself
runc                the default container runtime of the real node (Debian runc)
mmdebstrap          the Debian bases of the real node and of the agent image (hack/kube-tools.sh)
xz-utils            xz: the Istio release archives (shared/istio/*.tar.xz) the tools cache builds istiod and istio-cni from
gcc                 runc 1.5 in the tools cache, its one cgo build
libc6-dev           the C library headers of that cgo build
pkgconf|pkg-config  how that cgo build finds libseccomp (pkg-config)
libseccomp-dev      the seccomp support of runc 1.5 (linked against the libseccomp of Debian)'

names() { printf '%s\n' "$deps" | while read -r p _; do printf '%s\n' "$p"; done; }

missing() { # the packages to install, one a line
	# One dpkg-query for all: the installed ones among every alternative.
	# shellcheck disable=SC2046
	have=" $(dpkg-query -W -f='${Package} ${db:Status-Status}\n' $(names | tr '|' ' ') 2>/dev/null |
		while read -r p s; do [ "$s" != installed ] || printf '%s ' "$p"; done)"
	for spec in $(names); do
		found=
		for p in $(printf '%s' "$spec" | tr '|' ' '); do
			case "$have" in *" $p "*) found=1 ;; esac
		done
		[ -n "$found" ] || printf '%s\n' "${spec%%|*}"
	done
}

case "${1:-}" in
--list)
	printf '%s\n' "$deps"
	exit 0
	;;
--missing | "") ;;
*)
	echo "usage: $0 [--list | --missing]" >&2
	exit 2
	;;
esac

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
	echo "make deps: this machine has no dpkg-query or apt-get: it installs Debian packages and knows no other system." >&2
	echo "Install these (or your system's equivalents) yourself, then run make check or make demo:" >&2
	printf '%s\n' "$deps" | sed 's/^/  /' >&2
	exit 1
fi

todo=$(missing)
total=$(names | wc -l)
if [ "${1:-}" = --missing ]; then
	[ -z "$todo" ] || {
		printf '%s\n' "$todo"
		exit 1
	}
	exit 0
fi
if [ -z "$todo" ]; then
	echo "make deps: the $total Debian packages make check and make demo need are installed"
	exit 0
fi

list=$(printf "%s" "$todo" | tr "\n" " ")
if [ "$(id -u)" -ne 0 ]; then
	echo "make deps: missing Debian packages: $list" >&2
	echo "Installing them runs apt-get, which changes the system's packages and so needs root: run make deps as root (sudo make deps), or install them yourself. Why each is needed: $0 --list" >&2
	exit 1
fi

id= codename=
if [ -r /etc/os-release ]; then
	# shellcheck disable=SC1091
	. /etc/os-release
	id="${ID:-} ${ID_LIKE:-}"
	codename="${VERSION_CODENAME:-}"
fi
case "$id" in
*debian*) ;;
*)
	echo "make deps: /etc/os-release names neither Debian nor a Debian derivative ($id); install yourself: $list" >&2
	exit 1
	;;
esac
case "$codename" in
bookworm | trixie) ;;
*) echo "make deps: note: tested on Debian bookworm and trixie, this is ${codename:-an unnamed release}; trying apt-get anyway" ;;
esac

echo "make deps: installing with apt-get (as root: it changes the system's packages) what make check and make demo run on this machine:"
printf '%s\n' "$deps" | while read -r spec why; do
	case " $list " in *" ${spec%%|*} "*) printf '  %-19s %s\n' "${spec%%|*}" "$why" ;; esac
done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# The package lists first: a fresh machine's may be empty or stale.
# shellcheck disable=SC2086
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends $list; } >"$log" 2>&1; then
	cat "$log" >&2
	echo "make deps: apt-get failed (its output above)" >&2
	exit 1
fi
still=$(missing)
if [ -n "$still" ]; then
	echo "make deps: apt-get succeeded but these are still not installed: $(printf '%s' "$still" | tr '\n' ' ')" >&2
	exit 1
fi
echo "make deps: installed $list"
