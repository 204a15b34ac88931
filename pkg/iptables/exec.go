package iptables

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Cmd is one command to run inside a network namespace.
type Cmd struct {
	Name  string
	Args  []string
	Stdin []byte
}

// String renders the command line for logs and errors.
func (c Cmd) String() string { return strings.Join(append([]string{c.Name}, c.Args...), " ") }

// Executor runs commands inside a network namespace. It is the Applier's
// only way to run iptables, so tests of the planning logic substitute a
// fake; NetnsExecutor is the real one.
type Executor interface {
	// Run runs cmd inside the namespace at netnsPath ("" = the caller's
	// namespace) and returns its standard output.
	Run(ctx context.Context, netnsPath string, cmd Cmd) ([]byte, error)
}

// maxOutput bounds what a command may print; iptables-save of a pod
// namespace is tiny, so more than this is an error, not a memory hazard.
const maxOutput = maxSaveBytes

// NetnsExecutor runs commands in a namespace by switching a locked OS
// thread into it and forking from there; the child inherits the thread's
// namespace. It works for named netns paths, /proc/<pid>/ns/net and
// /proc/self/fd/<n>.
type NetnsExecutor struct{}

// Run implements Executor.
func (NetnsExecutor) Run(ctx context.Context, netnsPath string, cmd Cmd) ([]byte, error) {
	var out []byte
	run := func() error {
		c := exec.CommandContext(ctx, cmd.Name, cmd.Args...)
		c.Stdin = bytes.NewReader(cmd.Stdin)
		stdout := &capped{limit: maxOutput}
		stderr := &capped{limit: 4096}
		c.Stdout, c.Stderr = stdout, stderr
		c.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C"}
		err := c.Run()
		if stdout.over {
			return fmt.Errorf("%s: output exceeds %d bytes", cmd.Name, maxOutput)
		}
		if err != nil {
			msg := strings.TrimSpace(stderr.String())
			if msg != "" {
				return fmt.Errorf("%s: %w: %s", cmd, err, msg)
			}
			return fmt.Errorf("%s: %w", cmd, err)
		}
		out = stdout.Bytes()
		return nil
	}
	if netnsPath == "" {
		return out, run()
	}
	err := ns.WithNetNSPath(netnsPath, func(ns.NetNS) error { return run() })
	return out, err
}

// capped is a bytes.Buffer that stops growing at limit and remembers it.
type capped struct {
	bytes.Buffer
	limit int
	over  bool
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.limit - c.Len(); len(p) > room {
		c.over = true
		if room > 0 {
			c.Buffer.Write(p[:room])
		}
		return len(p), nil
	}
	return c.Buffer.Write(p)
}

// handle opens a netlink handle in the namespace ("" = current).
func handle(netnsPath string) (*netlink.Handle, error) {
	if netnsPath == "" {
		return netlink.NewHandle()
	}
	nsh, err := netns.GetFromPath(netnsPath)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", netnsPath, err)
	}
	defer nsh.Close()
	h, err := netlink.NewHandleAt(nsh)
	if err != nil {
		return nil, fmt.Errorf("netlink in netns %s: %w", netnsPath, err)
	}
	return h, nil
}

func nlFamily(f ruleset.Family) int {
	if f == ruleset.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}
