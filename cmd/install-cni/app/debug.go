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
	debugSock := nodefiles.ForSocket(sock).DebugSocket()
	client := &http.Client{
		Timeout: time.Minute,
		Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", debugSock)
		}},
	}
	resp, err := client.Get("http://agent" + path)
	if err != nil {
		return fmt.Errorf("ask the agent at %s: %w", debugSock, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(stdout, io.LimitReader(resp.Body, 64<<20)); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("the agent answered %s", resp.Status)
	}
	return nil
}
