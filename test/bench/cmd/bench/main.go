// Command bench measures the shipped install-cni and CNI plugin with the
// chart's default values and prints one table (docs/performance.md).
// `make bench` runs it as root; BENCH_QUICK=1 makes it a quick smoke run.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/test/bench"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func main() {
	os.Exit(run())
}

func envBool(name string) bool {
	b, _ := strconv.ParseBool(os.Getenv(name))
	return b
}

func run() int {
	installCNI := flag.String("install-cni", "bin/install-cni", "install-cni binary built by make build")
	plugin := flag.String("plugin", "bin/ambient-cni", "CNI plugin binary built by make build")
	out := flag.String("out", ".bench", "directory for the JSON results (and profiles)")
	quick := flag.Bool("quick", envBool("BENCH_QUICK"), "few samples and small enrollments: a smoke run of the harness (env BENCH_QUICK)")
	profile := flag.Bool("profile", envBool("BENCH_PROFILE"), "attach perf to the agent and write reports next to the JSON; inflates the figures (env BENCH_PROFILE)")
	flag.Parse()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	// Resolve paths before anything else can change them.
	for _, p := range []*string{installCNI, plugin, out} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return fail(err)
		}
		*p = abs
	}
	code, reexec, err := testnet.ProgramInOwnNetns()
	if err != nil {
		return fail(err)
	}
	if reexec {
		return code
	}
	root, err := kubeenv.RepoRoot()
	if err != nil {
		return fail(err)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return fail(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	res, runErr := bench.Run(ctx, bench.Options{
		RepoRoot: root, InstallCNI: *installCNI, Plugin: *plugin, Quick: *quick,
		Profile: *profile, ProfileDir: *out, Log: os.Stderr,
	})
	if res == nil {
		return fail(runErr)
	}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return fail(err)
	}
	name := "bench-" + res.Started.UTC().Format("20060102T150405Z")
	if res.Quick {
		name += "-quick"
	}
	var buf bytes.Buffer
	_ = res.WriteTable(&buf)
	table := buf.Bytes()
	for path, data := range map[string][]byte{
		filepath.Join(*out, name+".json"):  b,
		filepath.Join(*out, "latest.json"): b,
		filepath.Join(*out, "latest.txt"):  table,
	} {
		if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
			return fail(err)
		}
	}
	fmt.Fprintf(os.Stderr, "results: %s (%s)\n", filepath.Join(*out, name+".json"), time.Duration(res.Seconds*float64(time.Second)).Round(time.Second))
	os.Stdout.Write(table)
	if runErr != nil {
		return fail(runErr)
	}
	return 0
}
