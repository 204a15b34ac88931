package kubeenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// builderWait bounds the wait for a tool a running hack/kube-tools.sh is
// building: far beyond the slowest cold build on a busy machine, so only a
// builder that hangs reaches it.
const builderWait = 90 * time.Minute

// AwaitTool waits, when the tool at path is missing and a running
// hack/kube-tools.sh is building it (it lists the tools of its run under
// .builders/PID in the tools cache while it runs), until the tool is there
// or that builder is gone. make check starts the real node's e2e while the
// node's last tools still build beside it, so a test that needs one of
// them waits for it rather than failing. It returns whether it waited
// (the caller checks the path again either way); logf, if not nil, is
// told once a minute what it waits for.
func AwaitTool(name, path string, logf func(string, ...any)) bool {
	if exists(path) {
		return false
	}
	c, err := CacheDir()
	if err != nil {
		return false
	}
	pid := builderOf(filepath.Join(c, ".builders"), name)
	if pid == 0 {
		return false
	}
	start := time.Now()
	next := start
	for time.Since(start) < builderWait && alive(pid) && !exists(path) {
		if logf != nil && !time.Now().Before(next) {
			logf("waiting for %s: hack/kube-tools.sh (pid %d) is building it (%v so far)", name, pid, time.Since(start).Round(time.Second))
			next = next.Add(time.Minute)
		}
		time.Sleep(2 * time.Second)
	}
	return true
}

// builderOf is the pid of a live builder whose run lists name, or 0.
func builderOf(dir, name string) int {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 || !alive(pid) {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		if slices.Contains(strings.Fields(string(b)), name) {
			return pid
		}
	}
	return 0
}

// alive is whether pid runs: a zombie, a builder that ended but is not yet
// reaped, has ended.
func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// The state follows the command's closing parenthesis.
	if i := strings.LastIndexByte(string(b), ')'); i >= 0 && i+2 < len(b) {
		return b[i+2] != 'Z' && b[i+2] != 'X'
	}
	return true
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// stderrLog is AwaitTool's logger for callers without one of their own.
func stderrLog(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kubeenv: "+format+"\n", args...)
}
