#!/usr/bin/env bash
# hack/freshroot.sh: run the README's two commands in a clean Debian root
# filesystem that holds only Go and git, the proof that a fresh machine
# needs no other step (test/README.md keeps the last run's figures).
#
# usage: hack/freshroot.sh [DIR] [SUITE]   (root; DIR: a new folder, by
#        default a fresh one under /var/tmp; SUITE: bookworm, the default,
#        or trixie)
#        RESUME=1 hack/freshroot.sh DIR   the same steps again in an earlier
#        run's root, its caches kept, its source moved to HEAD
#        STEPS="deps ci demo" hack/freshroot.sh   other steps, in that order
#        (deps: hack/deps.sh; demo: make demo; check: CI=true make check;
#        ci: CI=true bash .ci/run, CI's own entry; default "deps demo check")
#
# It builds DIR/root with mmdebstrap (--variant=minbase --include=git:
# Debian's required packages, apt and git; no make, no gcc, no iptables),
# copies in the Go tree that runs this script, clones this repository's
# HEAD into DIR/root/src, binds /proc, /sys, /dev and the machine's
# real-node lock (/run/lock: two real nodes on one machine would fight over
# the host's cgroups and iptables), and then runs in it, entered as a
# machine's root (a mount namespace, pivot_root), as the README says for a
# machine without make: hack/deps.sh, make demo, CI=true make check. Every
# step is timed; the log is DIR/freshroot.log. The mounts are undone at the
# end, the folder is kept (its caches take about 22 GB: rm -rf it when
# done).
set -euo pipefail

[[ $(id -u) == 0 ]] || { echo "freshroot: needs root (mmdebstrap, mount namespaces, mounts)" >&2; exit 1; }
command -v mmdebstrap >/dev/null || { echo "freshroot: needs mmdebstrap (make deps installs it)" >&2; exit 1; }

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$(mktemp -d /var/tmp/freshroot.XXXXXX)}
suite=${2:-bookworm}
goroot=$(go env GOROOT)
log=$dir/freshroot.log

root=$dir/root
# RESUME=1 with the DIR of an earlier run: its root and caches are kept,
# its source is moved to this repository's HEAD, and the steps run again
# (after a failure that was the harness's, not the project's).
resume=${RESUME:-}
mkdir -p "$dir"
if [[ -n $resume ]]; then
	[[ -d $root/src ]] || { echo "freshroot: RESUME=1 but $root/src does not exist" >&2; exit 1; }
else
	[[ -z $(ls -A "$dir" 2>/dev/null) ]] || { echo "freshroot: $dir is not empty" >&2; exit 1; }
fi

stamp() { date +%s; }
step() { # step NAME CMD...: run and time one step, into the log and stdout
	local name=$1 t0 rc=0
	shift
	t0=$(stamp)
	echo "freshroot: $name ..." | tee -a "$log"
	"$@" 2>&1 | tee -a "$log" || rc=${PIPESTATUS[0]}
	echo "freshroot: $name: rc=$rc in $(($(stamp) - t0)) s" | tee -a "$log"
	return "$rc"
}

mounted=()
cleanup() {
	local m
	for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
		m=${mounted[i]}
		umount -R "$m" 2>/dev/null || umount -l -R "$m" 2>/dev/null || echo "freshroot: could not unmount $m" >&2
	done
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

bind() { # bind SRC DST: a recursive bind, undone at the end
	mkdir -p "$2"
	mount --rbind "$1" "$2"
	mount --make-rslave "$2"
	mounted+=("$2")
}

if [[ -n $resume ]]; then
	echo "freshroot: resuming in $root" | tee -a "$log"
	step "move the source to $(git -C "$repo" rev-parse --short HEAD)" \
		sh -c 'git -C "$1/src" fetch -q "$2" HEAD && git -C "$1/src" checkout -q FETCH_HEAD' _ "$root" "$repo"
else
	: >"$log"
	step "mmdebstrap $suite (minbase + git)" mmdebstrap --variant=minbase --include=git "$suite" "$root"
	step "copy Go ($(go env GOVERSION))" cp -a "$goroot" "$root/usr/local/go"
	step "clone $(git -C "$repo" rev-parse --short HEAD)" git clone -q "$repo" "$root/src"
fi
# CI's clone has a copy of the shared folder beside it, whose istio/ holds
# the source archives of Istio's releases (hack/kube-tools.sh): so has
# this one, beside src.
if [[ -d "$repo/../shared/istio" ]]; then
	rm -rf "$root/shared/istio"
	mkdir -p "$root/shared"
	cp -a "$repo/../shared/istio" "$root/shared/istio"
fi
# The machine's network settings, which are not the project's to install:
# its resolver, and the certificate authorities it added (a network that
# inspects TLS has one), which Debian's ca-certificates, installed by
# hack/deps.sh, adds to the new root's bundle.
cp /etc/resolv.conf "$root/etc/resolv.conf"
if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
	mkdir -p "$root/usr/local/share/ca-certificates"
	cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
# The loopback names and the machine's name resolving to itself, as
# Debian's installer writes them (127.0.0.1 localhost, ::1, 127.0.1.1
# <hostname>): mmdebstrap writes none, so a lookup of either went to the
# resolver, off the machine, and the real node's egress guard caught it
# (the suites that run istiod failed on four such packets).
grep -qE '^127\.0\.0\.1[[:space:]].*\blocalhost\b' "$root/etc/hosts" 2>/dev/null ||
	printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >>"$root/etc/hosts"
host=$(cat "$root/etc/hostname" 2>/dev/null || hostname)
grep -qw -- "$host" "$root/etc/hosts" 2>/dev/null || printf '127.0.1.1\t%s\n' "$host" >>"$root/etc/hosts"

# The root a mount point of its own, as on a machine (pivot_root needs
# one; kubelet too, which looks its root directory's mount up).
mount --bind "$root" "$root"
mounted+=("$root")
mount -t proc proc "$root/proc"
mounted+=("$root/proc")
bind /sys "$root/sys"
bind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/run"
mounted+=("$root/run")
bind /run/lock "$root/run/lock"

in_root() { # in_root CMD: a login-like root shell in the new root, Go on PATH
	# Not a chroot: a mount namespace of its own whose root the new root
	# is (pivot_root), as on a machine. In a chroot, runc's exec, which
	# kubelet's exec probes use, resolves paths from the namespace's real
	# root, not the container's, and every exec probe fails.
	unshare --mount --propagation slave -- /bin/sh -ec '
		cd "$1"
		mkdir -p .oldroot
		pivot_root . .oldroot
		umount -l /.oldroot
		cd /src
		exec /usr/bin/env -i HOME=/root TERM="$2" \
			PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
			/bin/bash -c "$3"' _ "$root" "${TERM:-dumb}" "$1"
}

t0=$(stamp)
rc=0
# By default in the README's order: a newcomer's make demo on empty
# caches, then make check (its stage table says how warm the demo left the
# caches). "ci" first instead gives CI's cold figure on a fresh machine.
for s in ${STEPS:-deps demo check}; do
	case $s in
	deps) step "hack/deps.sh (no make yet)" in_root 'hack/deps.sh' || rc=$? ;;
	demo) step "make demo" in_root 'make demo' || rc=$? ;;
	check) step "make check (CI=true)" in_root 'CI=true make check' || rc=$? ;;
	ci) step ".ci/run (CI=true)" in_root 'CI=true bash .ci/run' || rc=$? ;;
	*) echo "freshroot: unknown step $s (deps, demo, check, ci)" | tee -a "$log"; rc=2 ;;
	esac
	[[ $rc == 0 ]] || break
done
echo "freshroot: rc=$rc, $(($(stamp) - t0)) s from hack/deps.sh on; log: $log" | tee -a "$log"
exit "$rc"
