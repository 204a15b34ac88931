package iptables

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
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

// Router reads and changes a namespace's policy route and the state it
// depends on; NetlinkRouter is the real one, tests of control flow use
// fakes.
type Router interface {
	// State reports the namespace's loopback and IPv6 state.
	State(netnsPath string) (netns.State, error)
	// PolicyRouteState reports whether the fwmark rule and the local route
	// of want exist.
	PolicyRouteState(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (rule, route bool, err error)
	// EnsurePolicyRoute installs the rule and route if missing and reports
	// what it added. On error it has added nothing.
	EnsurePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (policyroute.Parts, error)
	// RemovePolicyRoute deletes the named parts if present.
	RemovePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute, parts policyroute.Parts) error
}

// NetlinkRouter implements Router over pkg/netns and pkg/policyroute: each
// call enters the namespace once.
type NetlinkRouter struct{}

// State implements Router.
func (NetlinkRouter) State(netnsPath string) (netns.State, error) { return netns.StateOf(netnsPath) }

// PolicyRouteState implements Router.
func (NetlinkRouter) PolicyRouteState(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (bool, bool, error) {
	c, err := dialRoute(netnsPath)
	if err != nil {
		return false, false, err
	}
	defer c.Close()
	return c.PolicyRouteState(f, want)
}

// EnsurePolicyRoute implements Router.
func (NetlinkRouter) EnsurePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute) (policyroute.Parts, error) {
	c, err := dialRoute(netnsPath)
	if err != nil {
		return policyroute.Parts{}, err
	}
	defer c.Close()
	return c.EnsurePolicyRoute(f, want)
}

// RemovePolicyRoute implements Router.
func (NetlinkRouter) RemovePolicyRoute(netnsPath string, f ruleset.Family, want ruleset.PolicyRoute, parts policyroute.Parts) error {
	c, err := dialRoute(netnsPath)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.RemovePolicyRoute(f, want, parts)
}

// dialRoute opens a policy-route connection in the namespace at netnsPath
// ("" = the caller's).
func dialRoute(netnsPath string) (*policyroute.Conn, error) {
	var c *policyroute.Conn
	err := netns.Do(netnsPath, func() error {
		st, err := netns.ReadState()
		if err != nil {
			return err
		}
		c, err = policyroute.Dial(st.LoopbackIndex)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", netnsPath, err)
	}
	return c, nil
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
	err := netns.Do(netnsPath, run)
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
	var h *netlink.Handle
	err := netns.Do(netnsPath, func() error {
		var err error
		if h, err = netlink.NewHandle(); err != nil {
			return fmt.Errorf("netlink in netns %s: %w", netnsPath, err)
		}
		return nil
	})
	return h, err
}

func nlFamily(f ruleset.Family) int {
	if f == ruleset.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}
