#!/bin/sh
# hack/fuzz.sh [-list]
#
# Runs every Go native fuzz target of the module (func FuzzX(f *testing.F)
# in a _test.go file) for FUZZTIME each (default 60s; a Go duration, or Nx
# for N inputs), one after another. Each package's test binary is built
# once, instrumented, and each of its targets run from the package's
# directory, as go test -fuzz would. A target that fails leaves its input
# in the package's testdata/fuzz/<target>/, which plain go test replays
# from then on: commit it with the fix, and it is the regression test.
# The script goes on with the other targets and exits non-zero if any
# failed, naming them. -list prints the targets and exits.
#
# make fuzz runs it with FUZZTIME=60s; make test with FUZZTIME=1s after
# the suite (plain go test already replays each target's seeds).
set -eu

FUZZTIME=${FUZZTIME:-60s}
GO=${GO:-go}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# "dir target" per line, sorted: only tracked files, so a scratch file in
# the tree adds nothing.
targets=$(git ls-files '*_test.go' | xargs grep -H -E '^func Fuzz[A-Za-z0-9_]+\(f \*testing\.F\)' |
	sed -E 's#^(.*)/[^/]*_test\.go:func (Fuzz[A-Za-z0-9_]+)\(.*#\1 \2#' | LC_ALL=C sort -u)

if [ "${1:-}" = "-list" ]; then
	echo "$targets"
	exit 0
fi

bindir=$(mktemp -d)
trap 'rm -rf "$bindir"' EXIT
cache=$($GO env GOCACHE)/fuzz
module=$($GO list -m)
failed=""
count=0
start=$(date +%s)
lastdir=""
for line in $(echo "$targets" | tr ' ' ':'); do
	dir=${line%%:*}
	target=${line#*:}
	bin="$bindir/$(echo "$dir" | tr / _).test"
	if [ "$dir" != "$lastdir" ]; then
		lastdir=$dir
		if ! $GO test -c -fuzz=. -o "$bin" "./$dir"; then
			failed="$failed $dir(build)"
			continue
		fi
	fi
	[ -x "$bin" ] || continue
	count=$((count + 1))
	# The cache directory go test -fuzz uses, so both grow one corpus.
	if (cd "$dir" && "$bin" -test.run='^$' -test.fuzz="^$target\$" -test.fuzztime="$FUZZTIME" \
		-test.fuzzcachedir="$cache/$module/$dir" -test.timeout=30m >"$bindir/out" 2>&1); then
		echo "ok   $dir $target"
	else
		echo "FAIL $dir $target"
		sed 's/^/    /' "$bindir/out"
		failed="$failed $dir:$target"
	fi
done
echo "fuzzed $count targets for $FUZZTIME each in $(($(date +%s) - start))s"
if [ -n "$failed" ]; then
	echo "failed:$failed"
	echo "each failing input is in its package's testdata/fuzz/<target>/; go test replays it"
	exit 1
fi
