#!/usr/bin/env bash
# hack/stages.sh: the stages of make check, run in order and timed.
#
# usage: hack/stages.sh make STAGE...     run make STAGE for each, in order, stopping
#                                          at the first failure (make -k: going on);
#                                          make check's recipe. bg:STAGE starts STAGE
#                                          in the background (niced, its lines prefixed
#                                          [STAGE], its log kept) and goes on;
#                                          STAGE_NICE_<stage> nices a foreground
#                                          stage, STAGE_BG_NICE_<stage> a
#                                          background one (19 unless set);
#                                          wait:STAGE waits for it, and fails, printing
#                                          the end of its log, if it failed
#        hack/stages.sh run NAME CMD...   run one command as the stage NAME
#        hack/stages.sh caches            one line: the tools cache (cold, warm or
#                                          partly) and the Go module and build caches
#        hack/stages.sh table FILE [NOTE] print FILE's stages as a table: each one's
#                                          start and seconds, then the wall clock
#
# When STAGE_TIMES names a file, make and run append to it what table reads:
# "plan NAME..." (the stages to come), "bg NAME" (a background stage),
# "start NAME MS" and "end NAME MS RC" (milliseconds since the epoch). A
# stage that started but never ended (the run was killed) is timed up to the
# table. Without STAGE_TIMES nothing is recorded: make check then runs
# exactly as a list of prerequisites would, background stages included.
# A background stage still running when a stage fails (without make -k),
# or when this script is killed, is killed with everything it started; one
# never waited for is waited for at the end, and its failure fails the run.
set -euo pipefail

now() { date +%s%3N; }

record() {
	[[ -z "${STAGE_TIMES:-}" ]] || echo "$*" >>"$STAGE_TIMES"
}

# children_cpu sets CHILDREN_CPU_MS to the CPU time (user + system) of
# this shell's children it has waited for: a stage's processes, all of
# them waited for by their parents, add up into it. Read in this process
# (a command substitution would read its own).
CLK_TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)
children_cpu() {
	local st f
	read -r st <"/proc/$BASHPID/stat"
	read -ra f <<<"${st##*) }"
	CHILDREN_CPU_MS=$(((f[13] + f[14]) * 1000 / CLK_TCK))
}

# machine_cpu records the machine's busy and total CPU time so far (all
# cores, in jiffies): the table tells from the first and the last how busy
# the machine was over the run, CPU-bound or waiting.
machine_cpu() {
	local _c u n s i w q sq st
	read -r _c u n s i w q sq st _ </proc/stat
	record stat "$(now)" $((u + n + s + q + sq + st)) $((u + n + s + q + sq + st + i + w))
}

run() { # run NAME CMD...
	local name=$1 rc=0 c0
	shift
	children_cpu
	c0=$CHILDREN_CPU_MS
	machine_cpu
	record start "$name" "$(now)"
	"$@" || rc=$?
	children_cpu
	# A wait:STAGE's children are the background stage's: its CPU is
	# that stage's row, not the wait's.
	if [[ $name == wait:* ]]; then
		record end "$name" "$(now)" "$rc"
	else
		record end "$name" "$(now)" "$rc" $((CHILDREN_CPU_MS - c0))
	fi
	machine_cpu
	return "$rc"
}

# Background stages: pid (its own process group) and log, by name.
declare -A bg_pid=() bg_log=()

start_bg() { # start_bg STAGE
	local s=$1 log
	log=$(mktemp "${TMPDIR:-/tmp}/stage-$s.XXXXXX.log")
	bg_log[$s]=$log
	record bg "$s"
	echo "stages: $s runs in the background (log: $log)"
	# A process group of its own (set -m), to be killed whole. Niced
	# (STAGE_BG_NICE, 19; STAGE_BG_NICE_<stage, - as _> for one stage):
	# the stages beside it keep the CPU they ask for, and it runs in what
	# they leave.
	set -m
	local var="STAGE_BG_NICE_${s//-/_}"
	(run "$s" nice -n "${!var:-${STAGE_BG_NICE:-19}}" "${MAKE:-make}" --no-print-directory "$s" 2>&1 |
		tee "$log" | sed -u "s/^/[$s] /") &
	bg_pid[$s]=$!
	set +m
}

wait_bg() { # wait_bg STAGE: 0 if it passed
	local s=$1 rc=0
	[[ -n "${bg_pid[$s]:-}" ]] || return 0
	wait "${bg_pid[$s]}" || rc=$?
	unset "bg_pid[$s]"
	if [[ $rc -ne 0 ]]; then
		echo "stages: background stage $s FAILED (exit $rc); its failures, then the end of its log (${bg_log[$s]}):" >&2
		grep -E -e '^(--- FAIL|FAIL|panic:)' -e '^ +--- FAIL' "${bg_log[$s]}" | head -n 40 >&2 || true
		tail -n 60 "${bg_log[$s]}" >&2
		return "$rc"
	fi
	rm -f "${bg_log[$s]}"
}

ended() { # ended PID: the process is gone or a zombie (ended, not yet waited for)
	local st
	st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 0
	[[ "${st%% *}" == Z ]]
}

kill_bg() {
	local s rc
	for s in "${!bg_pid[@]}"; do
		# One that already ended is waited for, not stopped: a failure of
		# its own is shown, or the run's end would hide it behind the
		# stage that stopped the run.
		if ended "${bg_pid[$s]}"; then
			wait_bg "$s" || true
			continue
		fi
		echo "stages: stopping background stage $s (log: ${bg_log[$s]})" >&2
		kill -TERM -- "-${bg_pid[$s]}" 2>/dev/null || true
		wait "${bg_pid[$s]}" 2>/dev/null || true
		unset "bg_pid[$s]"
	done
}

case "${1:-}" in
make)
	shift
	plan=()
	for s in "$@"; do plan+=("${s#bg:}"); done
	record plan "${plan[@]}"
	trap 'kill_bg' EXIT
	trap 'exit 143' TERM
	trap 'exit 130' INT
	rc=0
	for s in "$@"; do
		case "$s" in
		bg:*)
			start_bg "${s#bg:}"
			continue
			;;
		wait:*)
			s=${s#wait:}
			[[ -n "${bg_pid[$s]:-}" ]] || continue
			run "wait:$s" wait_bg "$s" && continue
			;;
		*)
			# STAGE_NICE_<stage, - as _>: a foreground stage's niceness
			# (default 0), so the background stages on the critical path
			# keep the CPU they ask for.
			var="STAGE_NICE_${s//-/_}"
			run "$s" nice -n "${!var:-0}" "${MAKE:-make}" --no-print-directory "$s" && continue
			;;
		esac
		rc=1
		[[ -n "${KEEP_GOING:-}" ]] || break
	done
	if [[ $rc -eq 0 || -n "${KEEP_GOING:-}" ]]; then
		for s in "${!bg_pid[@]}"; do wait_bg "$s" || rc=1; done
	fi
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
	declare -A start end rc bg cpu
	busy0="" tot0="" busy1="" tot1=""
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
		bg)
			bg[$name]=1
			;;
		start)
			seen "$name" || order+=("$name")
			start[$name]=$rest
			;;
		end)
			read -r end[$name] rc[$name] cpu[$name] <<<"$rest"
			;;
		stat)
			read -r busy tot <<<"$rest"
			[[ -n "${busy0:-}" ]] || { busy0=$busy tot0=$tot; }
			busy1=$busy tot1=$tot
			;;
		esac
	done <"$file"
	t=$(now) first="" last=0
	for n in "${order[@]}"; do
		[[ -n "${start[$n]:-}" ]] || continue
		[[ -n "$first" ]] && ((first <= ${start[$n]})) || first=${start[$n]}
		e=${end[$n]:-$t}
		((e <= last)) || last=$e
	done
	# The first column as wide as the longest name (wait:e2e-beside-tools).
	w=16
	for n in "${order[@]}"; do ((${#n} <= w)) || w=${#n}; done
	echo
	printf '%-*s %7s %8s %8s  %s\n' "$w" stage start seconds "cpu s" result
	for n in "${order[@]}"; do
		if [[ -z "${start[$n]:-}" ]]; then
			printf '%-*s %7s %8s %8s  %s\n' "$w" "$n" - - - "not run"
			continue
		fi
		e=${end[$n]:-$t}
		ms=$((e - ${start[$n]}))
		if [[ -z "${end[$n]:-}" ]]; then
			r="interrupted"
		elif [[ "${rc[$n]}" == 0 ]]; then
			r=ok
		else
			r="FAILED (exit ${rc[$n]})"
		fi
		[[ -z "${bg[$n]:-}" ]] || r="$r, in the background"
		c=-
		[[ -z "${cpu[$n]:-}" ]] || c=$(((${cpu[$n]} + 500) / 1000))
		printf '%-*s %7d %8d %8s  %s\n' "$w" "$n" $(((${start[$n]} - first + 500) / 1000)) $(((ms + 500) / 1000)) "$c" "$r"
	done
	if [[ -n "$first" ]]; then
		printf '%-*s %7s %8d %8s  %s\n' "$w" "wall clock" "" $(((last - first + 500) / 1000)) "" "first start to last end (stages overlap)"
	fi
	# cpu s is each stage's own CPU time (user + system, every core); the
	# machine's line says whether the run was CPU-bound (busy near 100 %:
	# only less work makes it faster) or waiting (room to overlap more).
	if [[ -n "$busy0" ]] && ((tot1 > tot0)); then
		echo "machine CPU busy $(((busy1 - busy0) * 100 / (tot1 - tot0))) % of the time on $(nproc) cores (every process, not only the stages')"
	fi
	[[ -z "$note" ]] || echo "at the start: $note"
	;;
*)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
	exit 2
	;;
esac
