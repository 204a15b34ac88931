// Command install-cni is the ambient-cni DaemonSet process: it installs
// the CNI plugin on the node, runs the node agent, and serves health and
// metrics. The process is assembled in ./app (its package doc maps its
// files by job); see docs/install-cni.md for its settings.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
)

func main() {
	if buildinfo.IsVersionFlag(os.Args[1:]) {
		fmt.Println(buildinfo.String("install-cni"))
		return
	}
	if len(os.Args) > 1 {
		sub := map[string]func([]string, func(string) string, io.Writer, io.Writer) error{
			"debug": app.DebugMain,
			"probe": app.ProbeMain,
		}[os.Args[1]]
		if sub != nil {
			if err := sub(os.Args[2:], os.Getenv, os.Stdout, os.Stderr); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			return
		}
	}
	if err := app.Main(os.Args[1:], os.Getenv, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "install-cni:", err)
		os.Exit(1)
	}
}
