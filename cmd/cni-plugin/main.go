// Command ambient-cni is the thin chained CNI plugin the container runtime
// execs for every pod; it hands each pod to the ambient node agent. All its
// logic lives in pkg/plugin. The runtime passes no arguments (CNI speaks
// through the environment and stdin; CNI_COMMAND=VERSION is CNI's own
// version query), so --version, for people, costs the runtime nothing.
package main

import (
	"os"

	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
	"github.com/ambient-cni/ambient-cni/pkg/plugin"
)

func main() {
	if buildinfo.IsVersionFlag(os.Args[1:]) {
		_, _ = os.Stdout.WriteString(buildinfo.String("ambient-cni") + "\n")
		return
	}
	os.Exit(plugin.New(os.Stdout, os.Stderr).Run(os.Getenv, os.Stdin))
}
