package testnet

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// ownNetnsEnv marks a test process re-executed in a network namespace of
// its own by MainInOwnNetns or RunInOwnNetns.
const ownNetnsEnv = "AMBIENT_TEST_OWN_NETNS"

// InOwnNetns reports whether this process was started, by MainInOwnNetns
// or RunInOwnNetns, in a network namespace of its own.
func InOwnNetns() bool { return os.Getenv(ownNetnsEnv) == "1" }

// MainInOwnNetns is for a TestMain whose tests use the test process's
// network namespace as "the host" (bridges, host routes and rules, an
// agent's host probe set, loopback servers): it runs the test binary again
// in a network namespace of its own and returns that run's exit code, and
// in that run it brings loopback up and returns run(). So nothing such a
// package makes in "its host" meets what other packages' tests, other
// test runs or a real node on the machine make in the real one, nothing
// can leave the machine through it, and the kernel removes whatever a
// test left when the run ends.
//
// prepare, when set, runs first, in the real namespace: work that needs
// the network (a first build that downloads modules), so the run in the
// private namespace finds it done; its failure is only reported, the
// tests then say what is missing. Without root (where the tests skip, or
// fail under CI=true) or with AMBIENT_UNIT_ONLY, run() runs here.
func MainInOwnNetns(prepare func() error, run func() int) int {
	if InOwnNetns() {
		if err := loopbackUp(); err != nil {
			fmt.Fprintf(os.Stderr, "bring up loopback in the test's own network namespace: %v\n", err)
			return 1
		}
		return run()
	}
	if os.Geteuid() != 0 || os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		return run()
	}
	if prepare != nil {
		if err := prepare(); err != nil {
			fmt.Fprintf(os.Stderr, "preparing the tests (outside their network namespace): %v\n", err)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "re-run the tests in their own network namespace: %v\n", err)
		return 1
	}
	code, err := runChild(exe, os.Args[1:], nil, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "tests in their own network namespace: %v\n", err)
		return 1
	}
	return code
}

// RunInOwnNetns is for one test that uses the test process's network
// namespace as "the host" (see MainInOwnNetns), in a package that does
// not run whole in a namespace of its own. Called outside, it runs the
// calling test again, alone, in a child test binary in a new network
// namespace, with env added to its environment, reports the child's
// output and result as the test's own, and returns false: the caller
// returns. Inside that child it brings loopback up and returns true: the
// caller goes on with the test there. Do what needs the real namespace
// (builds that may download) before calling it and pass the results in
// env.
func RunInOwnNetns(t *testing.T, env ...string) bool {
	t.Helper()
	if InOwnNetns() {
		if err := loopbackUp(); err != nil {
			t.Fatalf("bring up loopback in the test's own network namespace: %v", err)
		}
		return true
	}
	RequireRoot(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"-test.run=" + runPattern(t.Name()), "-test.v", "-test.count=1"}
	if dl, ok := t.Deadline(); ok {
		// Leave the child room to report its own timeout with stacks.
		args = append(args, "-test.timeout="+max(time.Until(dl)-10*time.Second, time.Second).String())
	}
	var out strings.Builder
	code, err := runChild(exe, args, env, &out, &out)
	// Quoted line by line, so the child's result lines are not taken for
	// this test's own (test2json reads indented "--- PASS" lines).
	t.Logf("in its own network namespace:\n%s", quote(out.String()))
	if err != nil {
		t.Fatalf("run the test in its own network namespace: %v", err)
	}
	if code != 0 {
		t.Fatalf("the test failed in its own network namespace (exit code %d); its output is above", code)
	}
	switch {
	case strings.Contains(out.String(), "--- PASS: "+t.Name()+" "):
	case strings.Contains(out.String(), "--- SKIP: "+t.Name()+" "):
		t.Skip("skipped in its own network namespace; its output is above")
	default:
		t.Fatal("the test did not run in its own network namespace (no result line); its output is above")
	}
	return false
}

func quote(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = "| " + l
	}
	return strings.Join(lines, "\n")
}

// runPattern is a -test.run pattern that matches exactly the named test
// (and its subtests).
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}

// runChild runs exe with args in a new network namespace and returns its
// exit code. The child dies with this process, and gets the interrupt,
// termination and quit signals this process gets (quit makes a Go test
// binary print its goroutines: go test sends it when a run hangs).
func runChild(exe string, args, env []string, stdout, stderr io.Writer) (int, error) {
	cmd := ownNetnsCmd(exe, args, env, stdout, stderr)
	// Pdeathsig follows the thread that started the child: keep this
	// goroutine on it until the child is gone.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("start %s in a new network namespace: %w", exe, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case s := <-sigs:
			_ = cmd.Process.Signal(s)
		case err := <-done:
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					return 0, fmt.Errorf("%s killed by %v", exe, ws.Signal())
				}
				return ee.ExitCode(), nil
			}
			return 0, err
		}
	}
}

// ownNetnsCmd is exe with args in a new network namespace, marked as
// such, dying with this process.
func ownNetnsCmd(exe string, args, env []string, stdout, stderr io.Writer) *exec.Cmd {
	cmd := exec.Command(exe, args...)
	cmd.Env = append(append(os.Environ(), env...), ownNetnsEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	return cmd
}

// ProgramInOwnNetns is MainInOwnNetns for a program (a benchmark, a suite
// that runs its parts side by side): called outside, it runs this program
// again with the same arguments in a network namespace of its own, passing
// on the signals it gets, and returns that run's exit code with reexec
// true (the caller exits with it); inside, it brings loopback up and
// returns reexec false (the caller goes on). It needs root.
func ProgramInOwnNetns() (code int, reexec bool, err error) {
	if InOwnNetns() {
		return 0, false, loopbackUp()
	}
	if os.Geteuid() != 0 {
		return 0, false, errors.New("run as root: it creates network namespaces and netfilter rules")
	}
	exe, err := os.Executable()
	if err != nil {
		return 0, true, err
	}
	code, err = runChild(exe, os.Args[1:], nil, os.Stdout, os.Stderr)
	return code, true, err
}

// StartInOwnNetns starts this program again with args in a new network
// namespace, with env added to this process's environment and its output
// to stdout and stderr; inside, ProgramInOwnNetns (or MainInOwnNetns)
// brings loopback up and goes on. The child gets SIGKILL when the thread
// that started it exits (Pdeathsig); the caller waits for it and passes
// signals on.
func StartInOwnNetns(args, env []string, stdout, stderr io.Writer) (*exec.Cmd, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("run as root: it creates network namespaces and netfilter rules")
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := ownNetnsCmd(exe, args, env, stdout, stderr)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s in a new network namespace: %w", exe, err)
	}
	return cmd, nil
}

func loopbackUp() error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	return netlink.LinkSetUp(lo)
}
