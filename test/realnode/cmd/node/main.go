// Command node runs a real Kubernetes node on this machine (package
// realnode) with ambient-cni installed by helm, and plays the demo on it.
//
//	node demo [-keep]   bring a node up, play the story, tear it down
//	                    (-keep: stay up until Ctrl-C to explore)
//	node up             bring a node up with ambient-cni; Ctrl-C tears it down
//	node down [-dir D]  tear down nodes whose owner died (or the one in D)
//
// It needs root and the tools of `hack/kube-tools.sh node`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/ambient-cni/ambient-cni/test/realnode"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: node demo [-keep] | up | down [-dir D]")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	switch os.Args[1] {
	case "demo":
		fs := flag.NewFlagSet("demo", flag.ExitOnError)
		keep := fs.Bool("keep", false, "leave the node running after the demo until Ctrl-C")
		_ = fs.Parse(os.Args[2:])
		err = realnode.Demo(ctx, os.Stdout, *keep)
	case "up":
		err = realnode.Demo(ctx, os.Stdout, true, realnode.SkipStory())
	case "down":
		fs := flag.NewFlagSet("down", flag.ExitOnError)
		dir := fs.String("dir", "", "node directory (default: every node whose owner died)")
		_ = fs.Parse(os.Args[2:])
		err = down(*dir)
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "node:", err)
		os.Exit(1)
	}
}

func down(dir string) error {
	dirs := []string{dir}
	if dir == "" {
		dirs, _ = filepath.Glob(filepath.Join(os.TempDir(), "ambient-node-*"))
		if len(dirs) == 0 {
			fmt.Println("no node to tear down")
		}
	}
	for _, d := range dirs {
		if err := realnode.DownDir(d, os.Stdout); err != nil {
			return err
		}
	}
	return nil
}
