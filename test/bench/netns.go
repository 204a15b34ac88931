package bench

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/vishvananda/netlink"
)

// privateNetnsEnv marks the re-executed benchmark process.
const privateNetnsEnv = "AMBIENT_BENCH_PRIVATE_NETNS"

// PrivateNetns makes sure the benchmark runs in a network namespace of its
// own: the first call re-executes the program in a new one and returns
// its exit code with reexec true (the caller exits with it); inside, it
// brings loopback up and returns reexec false. Everything the benchmark
// creates on "the host" (the bridge, veths, the agent's host probe set
// and rule, the API server's loopback ports) lives in that namespace, so
// nothing collides with other work on the machine, nothing can leave it
// (there is no route out), and the kernel removes it all when the run ends.
func PrivateNetns() (code int, reexec bool, err error) {
	if os.Getenv(privateNetnsEnv) == "1" {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return 0, false, err
		}
		return 0, false, netlink.LinkSetUp(lo)
	}
	if os.Geteuid() != 0 {
		return 0, false, errors.New("run the benchmark as root (it creates network namespaces and netfilter rules)")
	}
	cmd, err := StartInPrivateNetns(os.Args[1:], nil, os.Stdout, os.Stderr)
	if err != nil {
		return 0, true, err
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case s := <-sigs:
			// The child cleans up on the same signal.
			_ = cmd.Process.Signal(s)
		case err := <-done:
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				return ee.ExitCode(), true, nil
			}
			return 0, true, err
		}
	}
}

// StartInPrivateNetns starts this program again with args, in a new
// network namespace, as PrivateNetns does (inside, PrivateNetns brings
// loopback up and returns reexec false), with env added to this process's
// environment and its output to stdout and stderr. It gets SIGKILL if this
// process dies; the caller waits for it.
func StartInPrivateNetns(args, env []string, stdout, stderr io.Writer) (*exec.Cmd, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("run as root (it creates network namespaces and netfilter rules)")
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.Env = append(append(os.Environ(), env...), privateNetnsEnv+"=1")
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start in a new network namespace: %w", err)
	}
	return cmd, nil
}
