// Command kubectl-ambient_cni is the kubectl plugin `kubectl ambient-cni`
// (kubectl runs a binary of this name found on PATH): it asks ambient-cni's
// node agent of a pod's node why the pod is or is not captured, or how a
// node's agent is doing (package kubectlplugin). --version prints the
// version.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
	"github.com/ambient-cni/ambient-cni/pkg/kubectlplugin"
)

func main() {
	if buildinfo.IsVersionFlag(os.Args[1:]) {
		fmt.Println(buildinfo.String("kubectl-ambient_cni"))
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := kubectlplugin.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, kubectlplugin.ErrUsage):
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "kubectl ambient-cni:", err)
		os.Exit(1)
	}
}
