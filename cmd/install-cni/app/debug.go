package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// DebugUsage is the help of `install-cni debug`.
const DebugUsage = `usage: install-cni debug [--agent-socket PATH] pods | explain [NAMESPACE/NAME]

Asks the node agent on this node over its root-only debug socket (debug.sock
next to the agent socket) and prints its JSON answer:

  pods                    the pods the agent holds (captured), with their state
  explain                 every pod of the node: why it is or is not captured
  explain NAMESPACE/NAME  one pod: policy and reason, netns found, rules
                          verified just now (drift named), ztunnel's ack,
                          annotation, verdict and problems

Run it in the agent's container (kubectl exec), or as root on the node.
`

// DebugMain is `install-cni debug`: a client of the agent's debug socket,
// so operators need no curl in the image. The socket is found from
// --agent-socket, else AMBIENT_AGENT_SOCKET (set in the agent's container),
// else the default.
func DebugMain(args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("install-cni debug", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { _, _ = io.WriteString(stderr, DebugUsage) }
	sock := getenv(EnvName("agent-socket"))
	if sock == "" {
		sock = ambient.DefaultAgentSocket
	}
	fs.StringVar(&sock, "agent-socket", sock, "the agent socket; the debug socket is next to it")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var path string
	switch rest := fs.Args(); {
	case len(rest) == 1 && rest[0] == "pods":
		path = "/debug/pods"
	case len(rest) == 1 && rest[0] == "explain":
		path = "/debug/explain"
	case len(rest) == 2 && rest[0] == "explain":
		path = "/debug/explain?pod=" + url.QueryEscape(rest[1])
	default:
		fs.Usage()
		return errors.New("install-cni debug: want pods, explain or explain NAMESPACE/NAME")
	}
	code, err := AskAgent(context.Background(), nodefiles.ForSocket(sock), path, time.Minute, stdout)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("the agent answered %d %s", code, http.StatusText(code))
	}
	return nil
}

// ProbeUsage is the help of `install-cni probe`.
const ProbeUsage = `usage: install-cni probe [--agent-socket PATH] [--timeout D] live | ready

Kubelet's exec probe of the node agent on this node, asked over its root-only
debug socket (debug.sock next to the agent socket), so the agent holds no
host port for it:

  live    /livez: the plugin event server answers a STATUS round trip
          through its socket; before it listens, no start-up step has run
          over a minute while what it waits on answers
  ready   /readyz: plugin installed and chained, sockets listening, startup
          reconcile done (what fails is printed)

Exits 0 when the agent answers 200, 1 otherwise.
`

// ProbeMain is `install-cni probe`: what the chart's liveness and
// readiness probes exec (the image has no curl, and a TCP port on the host
// network may be taken by another pod). The socket is found as DebugMain
// finds it.
func ProbeMain(args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("install-cni probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { _, _ = io.WriteString(stderr, ProbeUsage) }
	sock := getenv(EnvName("agent-socket"))
	if sock == "" {
		sock = ambient.DefaultAgentSocket
	}
	fs.StringVar(&sock, "agent-socket", sock, "the agent socket; the debug socket is next to it")
	// Kubelet's default probe timeout (1 s) is too tight on a loaded
	// node; the chart's timeoutSeconds (5) is above this.
	timeout := fs.Duration("timeout", 4*time.Second, "how long to wait for the agent's answer")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var path string
	switch rest := fs.Args(); {
	case len(rest) == 1 && rest[0] == "live":
		path = "/livez"
	case len(rest) == 1 && rest[0] == "ready":
		path = "/readyz"
	default:
		fs.Usage()
		return errors.New("install-cni probe: want live or ready")
	}
	code, err := AskAgent(context.Background(), nodefiles.ForSocket(sock), path, *timeout, stdout)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("install-cni probe %s: the agent answered %d %s", fs.Arg(0), code, http.StatusText(code))
	}
	return nil
}

// AskAgent GETs path (e.g. /readyz, /debug/pods) from the agent whose run
// directory is layout, over its debug socket, copies
// the answer's body to out and returns its status code. Tests use it to
// read the agent's health as kubelet's exec probes do.
func AskAgent(ctx context.Context, layout nodefiles.Layout, path string, timeout time.Duration, out io.Writer) (int, error) {
	debugSock := layout.DebugSocket()
	client := &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", debugSock)
		}},
	}
	defer client.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent"+path, nil)
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("ask the agent at %s: %w", debugSock, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(out, io.LimitReader(resp.Body, 64<<20)); err != nil {
		return resp.StatusCode, fmt.Errorf("read the agent's answer: %w", err)
	}
	return resp.StatusCode, nil
}
