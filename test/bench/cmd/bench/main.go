// Command bench measures the shipped install-cni and CNI plugin with the
// chart's default values and prints one table (docs/performance.md).
// `make bench` runs it as root; BENCH_QUICK=1 makes it a quick smoke run.
// With -scale (`make bench-scale`) it measures the agent's memory with a
// large cluster's namespaces and pods in the API server instead; with
// -agents N (`make bench-agents`) what N node agents cost one API server,
// ours beside istio-cni's; with -fleet N,M (`make bench-fleet`) what N,
// then M simulated agents of each system cost one API server.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/test/bench"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
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
	scale := flag.Bool("scale", false, "measure the agent's memory with 10,000 namespaces and 20,000 pods of other nodes in the API server (with -quick: 200 and 400)")
	agents := flag.Int("agents", 0, "measure what this many node agents (ours, then istio-cni's) cost one API server (with -quick: at most 5)")
	fleet := flag.String("fleet", "", "measure what this many simulated node agents of each system cost one API server, comma-separated sizes, e.g. 100,1000 (with -quick: 20)")
	flag.Parse()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	if *fleet != "" {
		// Loopback only and no agent process: no network namespace of
		// its own, no root.
		return runFleetSim(*fleet, *quick, *out)
	}
	if (*scale || *agents > 0) && *profile {
		return fail(errors.New("-scale and -agents measure memory and the API server: -profile (perf) does not apply to them"))
	}
	if *scale && *agents > 0 {
		return fail(errors.New("-scale and -agents are separate runs"))
	}
	// Resolve paths before anything else can change them.
	for _, p := range []*string{installCNI, plugin, out} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return fail(err)
		}
		*p = abs
	}
	if !testnet.InOwnNetns() {
		// The reference plugins are built here, where the module proxy
		// is reachable; the run in its own network namespace finds
		// them cached.
		if _, _, err := cnibin.Build(); err != nil {
			return fail(fmt.Errorf("build the reference CNI plugins: %w", err))
		}
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
	// Istio's binaries for the peer column: their absence is reported in
	// the table, never a failure of our figures.
	istioInstallCNI, istioPlugin, istioChart, istioVersion, istioErr := bench.IstioBinaries(root)
	istioMissing := ""
	if istioErr != nil {
		istioMissing = istioErr.Error()
	} else {
		fmt.Fprintf(os.Stderr, "bench: Istio's istio-cni %s beside ours\n", istioVersion)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return fail(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *agents > 0 {
		n := *agents
		if *quick {
			n = min(n, 5)
		}
		return runFleet(ctx, bench.FleetOptions{
			RepoRoot: root, InstallCNI: *installCNI, Plugin: *plugin, Agents: n, Quick: *quick, Log: os.Stderr,
			IstioInstallCNI: istioInstallCNI, IstioPlugin: istioPlugin, IstioChart: istioChart, IstioMissing: istioMissing,
		}, *out)
	}
	if *scale {
		return runScale(ctx, bench.ScaleOptions{RepoRoot: root, InstallCNI: *installCNI, Plugin: *plugin, Quick: *quick, Log: os.Stderr}, *out)
	}
	res, runErr := bench.Run(ctx, bench.Options{
		RepoRoot: root, InstallCNI: *installCNI, Plugin: *plugin, Quick: *quick,
		Profile: *profile, ProfileDir: *out, Log: os.Stderr,
		IstioInstallCNI: istioInstallCNI, IstioPlugin: istioPlugin, IstioChart: istioChart, IstioMissing: istioMissing,
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

// runScale runs the scale benchmark, writes its JSON and report next to
// the other results and prints the report.
func runScale(ctx context.Context, o bench.ScaleOptions, out string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench -scale:", err)
		return 1
	}
	res, runErr := bench.RunScale(ctx, o)
	if res == nil {
		return fail(runErr)
	}
	if runErr != nil {
		// No figures without a converged run: a partial one would read
		// as a measurement.
		b, _ := json.MarshalIndent(res, "", "  ")
		fmt.Fprintf(os.Stderr, "partial result:\n%s\n", b)
		return fail(runErr)
	}
	if err := writeResult(out, "scale", res, res.Started, res.Quick, res.Seconds); err != nil {
		return fail(err)
	}
	return 0
}

// runFleetSim runs the fleet simulation for the sizes in list, writes its
// JSON and report next to the other results and prints the report.
func runFleetSim(list string, quick bool, out string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench -fleet:", err)
		return 1
	}
	var nodes []int
	for f := range strings.SplitSeq(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return fail(fmt.Errorf("-fleet %q: sizes are positive numbers", list))
		}
		nodes = append(nodes, n)
	}
	if quick {
		nodes = []int{20}
	}
	out, err := filepath.Abs(out)
	if err != nil {
		return fail(err)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fail(err)
	}
	root, err := kubeenv.RepoRoot()
	if err != nil {
		return fail(err)
	}
	// Istio's chart for its column: its absence is reported, never a
	// failure of our figures.
	_, _, istioChart, _, istioErr := bench.IstioBinaries(root)
	istioMissing := ""
	if istioErr != nil {
		istioMissing = istioErr.Error()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	res, runErr := bench.RunFleetSim(ctx, bench.FleetSimOptions{
		RepoRoot: root, Nodes: nodes, Quick: quick, Log: os.Stderr, IstioChart: istioChart, IstioMissing: istioMissing,
	})
	if res == nil {
		return fail(runErr)
	}
	if err := writeResult(out, "fleet", res, res.Started, res.Quick, res.Seconds); err != nil {
		return fail(err)
	}
	if runErr != nil {
		return fail(runErr)
	}
	return 0
}

// report is a result that prints itself for people.
type report interface {
	WriteReport(w io.Writer) error
}

// writeResult writes res as KIND-<started>[-quick].json and as
// KIND-latest.json and KIND-latest.txt (its report) in out, and prints the
// report.
func writeResult(out, kind string, res report, started time.Time, quick bool, seconds float64) error {
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	name := kind + "-" + started.UTC().Format("20060102T150405Z")
	if quick {
		name += "-quick"
	}
	var buf bytes.Buffer
	_ = res.WriteReport(&buf)
	rep := buf.Bytes()
	for path, data := range map[string][]byte{
		filepath.Join(out, name+".json"):        b,
		filepath.Join(out, kind+"-latest.json"): b,
		filepath.Join(out, kind+"-latest.txt"):  rep,
	} {
		if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
			return err
		}
	}
	fmt.Fprintf(os.Stderr, "results: %s (%s)\n", filepath.Join(out, name+".json"), time.Duration(seconds*float64(time.Second)).Round(time.Second))
	os.Stdout.Write(rep)
	return nil
}

// runFleet runs the fleet benchmark, writes its JSON and report next to
// the other results and prints the report. A system that failed is
// reported in its column; the run then fails.
func runFleet(ctx context.Context, o bench.FleetOptions, out string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench -agents:", err)
		return 1
	}
	res, runErr := bench.RunFleet(ctx, o)
	if res == nil {
		return fail(runErr)
	}
	if err := writeResult(out, "agents", res, res.Started, res.Quick, res.Seconds); err != nil {
		return fail(err)
	}
	if runErr != nil {
		return fail(runErr)
	}
	return 0
}
