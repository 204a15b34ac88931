// Command ambient-cni is the thin chained CNI plugin the container runtime
// execs for every pod; it hands each pod to the ambient node agent. All its
// logic lives in pkg/plugin.
package main

import (
	"os"

	"github.com/ambient-cni/ambient-cni/pkg/plugin"
)

func main() {
	os.Exit(plugin.New(os.Stdout, os.Stderr).Run(os.Getenv, os.Stdin))
}
