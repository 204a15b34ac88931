#!/usr/bin/env bash
# hack/flake.sh (make flake): run one test N times, optionally under CPU
# load, count passes and failures, and keep the logs of the failed runs.
#
# usage: hack/flake.sh -run REGEXP [-n N] [-load L] [-tags TAGS] [-timeout D] [-show REGEXP] PKG
#
# The package's test binary is built once (go test -c) and run N times as
# go test -count=1 -run REGEXP -v would run it, from the package directory.
# -show REGEXP prints, under each run's line, its log lines that match
# (grep -E), so that a passed run's figures are not lost with its log.
# -load L starts L busy loops (one core each) for the length of the runs;
# they stop when the runs end, and by themselves if this script is killed.
# CI=true (root tests fail instead of skipping) and AMBIENT_TEST_LONG=1 (the
# fault-injection suite runs) are set unless the environment sets them.
# A run that only skipped counts as skipped, not passed; a pattern that
# matches no test stops at the first run. Exit status 1 if any run failed
# or none passed.
set -euo pipefail

n=20 load=0 run= tags= timeout=30m pkg= show=
usage() {
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
	exit 2
}
while [[ $# -gt 0 ]]; do
	case "$1" in
	-n) n=${2:?}; shift 2 ;;
	-load) load=${2:-0}; shift 2 ;;
	-run) run=${2:-}; shift 2 ;;
	-tags) tags=${2:-}; shift 2 ;;
	-timeout) timeout=${2:?}; shift 2 ;;
	-show) show=${2:-}; shift 2 ;;
	-*) usage ;;
	*) [[ -z "$pkg" ]] || usage; pkg=$1; shift ;;
	esac
done
load=${load:-0}
[[ -n "$run" && -n "$pkg" ]] || {
	echo "flake: which test? make flake RUN=TestX PKG=./path/to/pkg/ [N=20] [LOAD=2] [TAGS=realnode]" >&2
	exit 2
}
[[ "$n" =~ ^[1-9][0-9]*$ && "$load" =~ ^[0-9]+$ ]] || {
	echo "flake: N must be a positive number and LOAD a number (got N=$n LOAD=$load)" >&2
	exit 2
}
GO=${GO:-go}
export CI=${CI:-true} AMBIENT_TEST_LONG=${AMBIENT_TEST_LONG:-1}

dirs=$("$GO" list -tags "$tags" -f '{{.Dir}}' "$pkg")
[[ $(wc -l <<<"$dirs") -eq 1 ]] || {
	echo "flake: PKG must name one package; $pkg names $(wc -l <<<"$dirs")" >&2
	exit 2
}
out=$(mktemp -d "${TMPDIR:-/tmp}/flake-XXXXXX")
loops=()
stop() {
	((${#loops[@]} == 0)) || kill "${loops[@]}" 2>/dev/null || true
	rm -f "$out/pkg.test"
}
trap stop EXIT

echo "flake: building $pkg's tests"
"$GO" test -c -tags "$tags" -o "$out/pkg.test" "$pkg"
[[ -x "$out/pkg.test" ]] || {
	echo "flake: $pkg has no tests" >&2
	exit 2
}

for ((i = 0; i < load; i++)); do
	# Busy until this script is gone, even if it is killed before its trap runs.
	sh -c 'while kill -0 '"$$"' 2>/dev/null; do :; done' &
	loops+=($!)
done

read -r load1 _ </proc/loadavg
echo "flake: $run in $pkg, $n runs, $load busy loops (load average $load1 at the start); the logs of failed runs go to $out"
pass=0 fail=0 skip=0
for ((i = 1; i <= n; i++)); do
	log="$out/run-$i.log"
	t0=$(date +%s)
	rc=0
	(cd "$dirs" && exec "$out/pkg.test" -test.run "$run" -test.count=1 -test.v -test.timeout "$timeout") >"$log" 2>&1 || rc=$?
	s=$(($(date +%s) - t0))
	shown=
	[[ -z "$show" ]] || shown=$(grep -E -- "$show" "$log" | head -n 10 | sed 's/^ */flake:   /' || true)
	if ((rc != 0)); then
		fail=$((fail + 1))
		echo "flake: run $i/$n FAILED in $s s (exit $rc): $log"
		grep -E '^\s*--- FAIL|^panic:' "$log" | head -n 5 | sed 's/^/flake:   /' || true
		[[ -z "$shown" ]] || echo "$shown"
	elif grep -q '^--- PASS' "$log"; then
		pass=$((pass + 1))
		echo "flake: run $i/$n passed in $s s"
		[[ -z "$shown" ]] || echo "$shown"
		rm -f "$log"
	elif grep -q '^--- SKIP' "$log"; then
		skip=$((skip + 1))
		echo "flake: run $i/$n SKIPPED in $s s: $(grep -B 1 '^--- SKIP' "$log" | head -n 1 | sed 's/^ *//')"
	else
		echo "flake: $run matches no test in $pkg (log: $log)" >&2
		exit 2
	fi
done
read -r load1 _ </proc/loadavg
echo "flake: $run in $pkg: $pass passed, $fail failed, $skip skipped of $n runs under $load busy loops (load average $load1 at the end)"
if ((fail + skip > 0)); then
	echo "flake: the logs of the failed and skipped runs: $out"
else
	rm -f "$out/pkg.test"
	rmdir "$out" 2>/dev/null || true
fi
# All skipped proves nothing: that fails too.
((fail == 0 && pass > 0))
