#!/usr/bin/env bash
# hack/stages.sh: the stages of make check, run in order and timed.
#
# usage: hack/stages.sh make STAGE...     run make STAGE for each, in order, stopping
#                                          at the first failure (make -k: going on);
#                                          make check's recipe
#        hack/stages.sh run NAME CMD...   run one command as the stage NAME
#        hack/stages.sh caches            one line: the tools cache (cold, warm or
#                                          partly) and the Go module and build caches
#        hack/stages.sh table FILE [NOTE] print FILE's stages as a table of seconds
#
# When STAGE_TIMES names a file, make and run append to it what table reads:
# "plan NAME..." (the stages to come), "start NAME MS" and "end NAME MS RC"
# (milliseconds since the epoch). A stage that started but never ended (the
# run was killed) is timed up to the table. Without STAGE_TIMES nothing is
# recorded: make check then runs exactly as a list of prerequisites would.
set -euo pipefail

now() { date +%s%3N; }

record() {
	[[ -z "${STAGE_TIMES:-}" ]] || echo "$*" >>"$STAGE_TIMES"
}

run() { # run NAME CMD...
	local name=$1 rc=0
	shift
	record start "$name" "$(now)"
	"$@" || rc=$?
	record end "$name" "$(now)" "$rc"
	return "$rc"
}

case "${1:-}" in
make)
	shift
	record plan "$@"
	rc=0
	for s in "$@"; do
		if ! run "$s" "${MAKE:-make}" --no-print-directory "$s"; then
			rc=1
			[[ -n "${KEEP_GOING:-}" ]] || break
		fi
	done
	exit "$rc"
	;;
run)
	shift
	[[ $# -ge 2 ]] || {
		echo "usage: $0 run NAME CMD..." >&2
		exit 2
	}
	run "$@"
	;;
caches)
	repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
	built=0 total=0 state="unknown (hack/kube-tools.sh --list failed)"
	if list=$("$repo/hack/kube-tools.sh" --list 2>/dev/null); then
		while read -r _ _ s _; do
			total=$((total + 1))
			[[ "$s" != built ]] || built=$((built + 1))
		done <<<"$list"
		if ((built == total)); then
			state="warm ($built of $total tools built)"
		elif ((built == 0)); then
			state="cold (none of $total tools built)"
		else
			state="partly warm ($built of $total tools built)"
		fi
	fi
	gocache() { # gocache VAR: empty or present
		local d
		d=$("${GO:-go}" env "$1" 2>/dev/null) || {
			echo unknown
			return
		}
		if [[ -d "$d" && -n "$(ls -A "$d" 2>/dev/null)" ]]; then echo present; else echo empty; fi
	}
	echo "tools cache $state; Go module cache $(gocache GOMODCACHE), build cache $(gocache GOCACHE)"
	;;
table)
	file=${2:?usage: $0 table FILE [NOTE]}
	note=${3:-}
	declare -A start end rc
	order=()
	seen() {
		local o
		for o in "${order[@]}"; do [[ "$o" != "$1" ]] || return 0; done
		return 1
	}
	while read -r kind name rest; do
		case "$kind" in
		plan)
			for n in $name $rest; do seen "$n" || order+=("$n"); done
			;;
		start)
			seen "$name" || order+=("$name")
			start[$name]=$rest
			;;
		end)
			end[$name]=${rest% *}
			rc[$name]=${rest#* }
			;;
		esac
	done <"$file"
	t=$(now) total=0
	echo
	echo "stage         seconds  result"
	for n in "${order[@]}"; do
		if [[ -z "${start[$n]:-}" ]]; then
			printf '%-12s %8s  %s\n' "$n" - "not run"
			continue
		fi
		e=${end[$n]:-$t}
		ms=$((e - ${start[$n]}))
		total=$((total + ms))
		if [[ -z "${end[$n]:-}" ]]; then
			r="interrupted"
		elif [[ "${rc[$n]}" == 0 ]]; then
			r=ok
		else
			r="FAILED (exit ${rc[$n]})"
		fi
		printf '%-12s %8d  %s\n' "$n" $(((ms + 500) / 1000)) "$r"
	done
	printf '%-12s %8d\n' total $(((total + 500) / 1000))
	[[ -z "$note" ]] || echo "at the start: $note"
	;;
*)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
	exit 2
	;;
esac
