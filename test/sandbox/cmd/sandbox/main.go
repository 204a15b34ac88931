// Command sandbox runs ambient-cni's main job locally (as root): a real API
// server, install-cni, a ztunnel stand-in and simulated pods, then shows a
// namespace being captured and released. `make sandbox` runs it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ambient-cni/ambient-cni/test/sandbox"
)

func main() {
	installCNI := flag.String("install-cni", "bin/install-cni", "install-cni binary (make build)")
	stay := flag.Bool("stay", false, "keep the sandbox up after the demo until Ctrl-C")
	keepDir := flag.Bool("keep-dir", false, "keep the working directory (logs) afterwards")
	flag.Parse()
	dir, err := os.MkdirTemp("", "ambient-sandbox-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err = sandbox.Run(ctx, sandbox.Options{Dir: dir, InstallCNI: *installCNI, Stay: *stay, Out: os.Stdout})
	stop()
	if *keepDir {
		fmt.Println("working directory kept:", dir)
	} else {
		_ = os.RemoveAll(dir)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "sandbox:", err)
		os.Exit(1)
	}
}
