#!/bin/sh
# hack/node-paths.sh snapshot FILE | check FILE
#
# The test suite must never touch a real node's paths: on a developer's node
# they hold the running agent's capture records, sockets, CNI config and
# plugins. `snapshot` records a listing of those paths (every entry's type,
# mode, size and mtime; absent paths are recorded as absent); `check`
# compares the paths with the recorded listing and fails, naming each
# difference, if anything was created, removed or changed. make test runs
# one before and one after the suite.
set -eu

PATHS="/var/run/ambient-cni /var/lib/ambient-cni /etc/cni/net.d /opt/cni/bin /var/run/ztunnel"

listing() {
	for p in $PATHS; do
		if [ -e "$p" ] || [ -L "$p" ]; then
			# %y type, %m mode, %s size, %T@ mtime, %p path; sockets and
			# directories too, so a new socket or record shows.
			find "$p" -printf '%y %m %s %T@ %p\n' 2>/dev/null | LC_ALL=C sort -k5
		else
			echo "absent $p"
		fi
	done
}

case "${1:-}" in
snapshot)
	[ $# -eq 2 ] || { echo "usage: $0 snapshot FILE" >&2; exit 2; }
	listing >"$2"
	;;
check)
	[ $# -eq 2 ] || { echo "usage: $0 check FILE" >&2; exit 2; }
	[ -f "$2" ] || { echo "$0: no snapshot $2 (run $0 snapshot $2 first)" >&2; exit 2; }
	now=$(mktemp)
	trap 'rm -f "$now"' EXIT
	listing >"$now"
	if ! diff -u "$2" "$now" >&2; then
		echo "the tests changed a real node's paths ($PATHS): '-' before, '+' after; every test must use temporary paths" >&2
		exit 1
	fi
	;;
*)
	echo "usage: $0 snapshot FILE | check FILE" >&2
	exit 2
	;;
esac
