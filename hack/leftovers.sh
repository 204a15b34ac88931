#!/bin/sh
# hack/leftovers.sh snapshot FILE | check FILE
#
# Tests clean up what they make on the machine. This catches what outlives
# a suite even when every test passed: named network namespaces (a pod
# sandbox's, made by testutils.NewNS; its mount stays and its process may
# hold it) and the simulated kubelets' cgroup roots (kubepods-sim-*, left
# while a pod's process lives on). `snapshot` records them before the
# suite; `check` fails, naming each one, if any appeared since.
set -eu

listing() {
	ls -1 /var/run/netns 2>/dev/null | sed 's|^|netns |' || true
	for h in /sys/fs/cgroup /sys/fs/cgroup/*; do
		[ -d "$h" ] || continue
		for d in "$h"/kubepods-sim-*; do
			[ -d "$d" ] && echo "cgroup $d"
		done
	done
	:
}

case "${1:-}" in
snapshot)
	[ $# -eq 2 ] || { echo "usage: $0 snapshot FILE" >&2; exit 2; }
	listing | LC_ALL=C sort >"$2"
	;;
check)
	[ $# -eq 2 ] || { echo "usage: $0 check FILE" >&2; exit 2; }
	[ -f "$2" ] || { echo "$0: no snapshot $2 (run $0 snapshot $2 first)" >&2; exit 2; }
	new=$(listing | LC_ALL=C sort | LC_ALL=C comm -13 "$2" -)
	if [ -n "$new" ]; then
		echo "$new" >&2
		echo "the tests left these behind (a sandbox never torn down: its netns, its pod process in the cgroup); every test must remove what it makes" >&2
		exit 1
	fi
	;;
*)
	echo "usage: $0 snapshot FILE | check FILE" >&2
	exit 2
	;;
esac
