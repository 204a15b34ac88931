// Command ambient-cni is the thin chained CNI plugin the container runtime
// execs for every pod; it hands each pod to the ambient node agent. All its
// logic lives in pkg/plugin.
package main

import (
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ambient-cni/ambient-cni/pkg/plugin"
)

func main() {
	if err := plugin.GuardNetnsEnv(os.Getenv, os.Setenv); err != nil {
		os.Exit(1)
	}
	skel.PluginMainFuncs(plugin.New(os.Stdout, os.Stderr).Funcs(), plugin.VersionInfo, plugin.About)
}
