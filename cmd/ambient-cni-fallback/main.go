// Command ambient-cni-fallback is the plugin's second tier (package
// fallback): the plugin execs it, from the agent's state directory, only
// while the node agent cannot answer. It reads one request (JSON) on
// stdin, prints one verdict (JSON) on stdout and exits 0, or says on
// stderr why it has none and exits 1.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/fallback"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// timeout bounds both GETs together; the plugin bounds the whole exec too.
const timeout = 5 * time.Second

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ambient-cni-fallback:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) != 2 {
		return fmt.Errorf("usage: %s STATE_DIR < request.json", filepath.Base(os.Args[0]))
	}
	b, err := io.ReadAll(io.LimitReader(os.Stdin, ambient.MaxFallbackBytes))
	if err != nil {
		return err
	}
	var req ambient.FallbackRequest
	if err := json.Unmarshal(b, &req); err != nil || req.Namespace == "" || req.Name == "" {
		return fmt.Errorf("bad request %q", b)
	}
	cred, err := plugincred.Read(nodefiles.Default().WithStateDir(os.Args[1]).PluginCredential())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	v, err := fallback.Decide(ctx, cred, req)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(v)
}
