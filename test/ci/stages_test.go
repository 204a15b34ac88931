package ci

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// fakeMake stands in for make: stage NAME prints its start, sleeps
// FAKE_SLEEP_NAME seconds (or forever, "infinity"), fails when FAKE_FAIL
// names it, and prints its end.
const fakeMake = `#!/usr/bin/env bash
s=${!#}; v=FAKE_SLEEP_${s//-/_}
echo "stage $s start"
sleep "${!v:-0}"
[[ " ${FAKE_FAIL:-} " != *" $s "* ]] || { echo "stage $s broke"; exit 2; }
echo "stage $s done"
`

// stages runs hack/stages.sh make STAGES... with the fake make and env,
// bounded by a deadline far beyond what the stages take, and returns its
// output, the recorded timings' table and its error.
func stages(t *testing.T, env []string, args ...string) (string, string, error) {
	t.Helper()
	dir := t.TempDir()
	times := filepath.Join(dir, "times")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{script(t, "stages.sh"), "make"}, args...)...)
	cmd.Env = append(os.Environ(), append(env, "MAKE="+writeExe(t, dir, "make", fakeMake), "STAGE_TIMES="+times, "KEEP_GOING=", "TMPDIR="+dir)...)
	// The background stage's sleep must not hold the pipe open past the
	// script itself: a kill of its process group ends it.
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("hack/stages.sh make %s hung:\n%s", strings.Join(args, " "), out)
	}
	table, terr := exec.Command("bash", script(t, "stages.sh"), "table", times).CombinedOutput()
	if terr != nil {
		t.Fatalf("stages.sh table: %v\n%s", terr, table)
	}
	return string(out), string(table), err
}

// row returns the table's row of a stage.
func row(t *testing.T, table, stage string) string {
	t.Helper()
	for l := range strings.SplitSeq(table, "\n") {
		if strings.HasPrefix(l, stage+" ") {
			return l
		}
	}
	t.Fatalf("no row %q in the table:\n%s", stage, table)
	return ""
}

func TestStagesBackgroundOverlapsAndIsWaitedFor(t *testing.T) {
	out, table, err := stages(t, []string{"FAKE_SLEEP_b=2"}, "a", "bg:b", "c", "wait:b", "d")
	if err != nil {
		t.Fatalf("stages failed: %v\n%s", err, out)
	}
	// c ran while b was still running, d only once b was done.
	for _, want := range []string{"[b] stage b start", "[b] stage b done", "stage c done", "stage d start"} {
		if !strings.Contains(out, want) {
			t.Fatalf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Index(out, "stage c done") > strings.Index(out, "[b] stage b done") {
		t.Errorf("c waited for the background stage b:\n%s", out)
	}
	if strings.Index(out, "stage d start") < strings.Index(out, "[b] stage b done") {
		t.Errorf("d started before wait:b saw b done:\n%s", out)
	}
	if r := row(t, table, "b"); !strings.Contains(r, "ok, in the background") {
		t.Errorf("b's row: %q\n%s", r, table)
	}
	if r := row(t, table, "wait:b"); !regexp.MustCompile(`\s-\s+ok$`).MatchString(r) {
		t.Errorf("wait:b's row (no CPU of its own): %q\n%s", r, table)
	}
	// Every stage that ran has its CPU time (the fake make's, a fraction
	// of a second: 0), foreground or background, and the machine's is
	// summed up.
	for _, s := range []string{"a", "b", "c", "d"} {
		if r := row(t, table, s); !regexp.MustCompile(`^\S+\s+\d+\s+\d+\s+\d+\s+ok`).MatchString(r) {
			t.Errorf("%s's row has no CPU time: %q\n%s", s, r, table)
		}
	}
	row(t, table, "wall clock")
	row(t, table, "machine CPU busy")
}

func TestStagesFailedBackgroundFailsWithItsLog(t *testing.T) {
	out, table, err := stages(t, []string{"FAKE_FAIL=b"}, "a", "bg:b", "c", "wait:b", "d")
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("stages passed (%v) though the background stage failed:\n%s", err, out)
	}
	if !regexp.MustCompile(`background stage b FAILED \(exit 2\)[^\n]*\n(.*\n)*stage b broke`).MatchString(out) {
		t.Errorf("the failure does not show b's log:\n%s", out)
	}
	if strings.Contains(out, "stage d") {
		t.Errorf("d ran after b failed:\n%s", out)
	}
	if r := row(t, table, "d"); !strings.Contains(r, "not run") {
		t.Errorf("d's row: %q\n%s", r, table)
	}
}

func TestStagesFailureStopsBackground(t *testing.T) {
	// b would never end: the failure of c must stop it, not wait for it.
	out, table, err := stages(t, []string{"FAKE_SLEEP_b=infinity", "FAKE_FAIL=c"}, "a", "bg:b", "c", "wait:b", "d")
	if err == nil {
		t.Fatalf("stages passed though c failed:\n%s", out)
	}
	if !strings.Contains(out, "stopping background stage b") {
		t.Errorf("b was not stopped:\n%s", out)
	}
	if r := row(t, table, "b"); !strings.Contains(r, "interrupted, in the background") {
		t.Errorf("b's row: %q\n%s", r, table)
	}
}

func TestStagesTableWallClock(t *testing.T) {
	// A background stage of 100 s beside two of 40 s and 50 s: the wall
	// clock is 100 s, not the 190 s the stages sum to. a used 75 s of CPU
	// (c's record has none: "-"), and the machine was busy 300 of the 400
	// jiffies between the first and the last sample.
	f := filepath.Join(t.TempDir(), "times")
	rec := "plan a b c wait:b\nbg b\nstat 1000000 1000 2000\nstart a 1000000\nstart b 1000000\nend a 1040000 0 75000\nstart c 1040000\nend c 1090000 0\nstart wait:b 1090000\nend b 1100000 0 120400\nend wait:b 1100000 0\nstat 1100000 1300 2400\n"
	if err := os.WriteFile(f, []byte(rec), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("bash", script(t, "stages.sh"), "table", f).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	table := string(out)
	for stage, want := range map[string]string{
		"a":          `^a\s+0\s+40\s+75\s+ok$`,
		"b":          `^b\s+0\s+100\s+120\s+ok, in the background$`,
		"c":          `^c\s+40\s+50\s+-\s+ok$`,
		"wait:b":     `^wait:b\s+90\s+10\s+-\s+ok$`,
		"wall clock": `^wall clock\s+100\s`,
		"machine":    `^machine CPU busy 75 % `,
	} {
		if r := row(t, table, stage); !regexp.MustCompile(want).MatchString(r) {
			t.Errorf("%s's row %q does not match %s\n%s", stage, r, want, table)
		}
	}
}
