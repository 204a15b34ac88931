package chaos

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// longEnv turns the suite on; make test-long sets it.
const longEnv = "AMBIENT_TEST_LONG"

// kube is the etcd + kube-apiserver of every test but the outage one,
// which stops its own.
var kube kubeenv.Shared

func TestMain(m *testing.M) {
	if os.Getenv(longEnv) == "1" && os.Getenv("AMBIENT_UNIT_ONLY") == "" && os.Geteuid() == 0 {
		if os.Getenv(groupEnv) == "" && !runFlagGiven() {
			// The whole suite: its scenarios side by side, each group in a
			// network namespace of its own.
			os.Exit(runGroups())
		}
		code, reexec, err := testnet.ProgramInOwnNetns()
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos: run in a network namespace of its own:", err)
			os.Exit(1)
		}
		if reexec {
			os.Exit(code)
		}
	}
	code := kube.Run(m)
	if shippedDir != "" {
		_ = os.RemoveAll(shippedDir)
	}
	os.Exit(code)
}

// cleanupMargin is what a test keeps of go test's -timeout for its
// cleanups (nodes torn down, namespaces removed) after its work's context
// ends.
const cleanupMargin = 2 * time.Minute

// runContext is a test's context for its work: no budget of its own (on
// a busy machine every step is slower), ending cleanupMargin before go
// test's -timeout would panic, so that a hang fails the test with its
// cleanups run.
func runContext(t *testing.T) context.Context {
	d, ok := t.Deadline()
	if !ok {
		return t.Context()
	}
	ctx, cancel := context.WithDeadline(t.Context(), d.Add(-cleanupMargin))
	t.Cleanup(cancel)
	return ctx
}

// requireLong skips unless the long suite was asked for, and checks every
// prerequisite (a missing one fails under CI=true).
func requireLong(t *testing.T) {
	t.Helper()
	if os.Getenv(longEnv) != "1" {
		t.Skipf("the fault-injection suite takes minutes: make test-long runs it (%s=1)", longEnv)
	}
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skip("skipping: AMBIENT_UNIT_ONLY is set")
	}
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "make", "go", "nft", "iptables-save", "ip6tables-save")
	for _, tool := range []string{kubeenv.Etcd, kubeenv.KubeAPIServer, kubeenv.Helm} {
		kubeenv.RequireTool(t, tool)
	}
	podproc.RequireHierarchies(t)
	cnibin.Paths(t)
}

// shipped is what the tests run: the binaries make build builds, and the
// chart's rendered defaults.
type shipped struct {
	installCNI, plugin string
	chart              *simnode.Shipped
}

var (
	shippedOnce sync.Once
	shippedVal  *shipped
	shippedErr  error
	// shippedDir holds the built binaries until the test process ends.
	shippedDir string
)

// shippedBuild builds bin/install-cni and bin/ambient-cni as make build
// does (into a directory of the test run) and renders the chart, once.
func shippedBuild(t *testing.T) *shipped {
	t.Helper()
	shippedOnce.Do(func() {
		root, err := kubeenv.RepoRoot()
		if err != nil {
			shippedErr = err
			return
		}
		if shippedDir, err = os.MkdirTemp("", "achaos-bin-"); err != nil {
			shippedErr = err
			return
		}
		bin := filepath.Join(shippedDir, "bin")
		if out, err := exec.Command("make", "-C", root, "--no-print-directory", "build", "BIN="+bin).CombinedOutput(); err != nil {
			shippedErr = fmt.Errorf("make build: %v\n%s", err, out)
			return
		}
		chart, err := simnode.RenderChart(context.Background(), root)
		if err != nil {
			shippedErr = err
			return
		}
		shippedVal = &shipped{
			installCNI: filepath.Join(bin, "install-cni"), plugin: filepath.Join(bin, "ambient-cni"),
			chart: chart,
		}
	})
	if shippedErr != nil {
		t.Fatalf("shipped binaries: %v", shippedErr)
	}
	return shippedVal
}

// groupEnv names the group a re-executed test process runs (see runGroups).
const groupEnv = "AMBIENT_CHAOS_GROUP"

// runFlagGiven reports whether the test binary was asked for chosen tests
// (go test -run): then it runs them in one process, in one private netns.
func runFlagGiven() bool {
	for _, a := range os.Args[1:] {
		if strings.HasPrefix(a, "-test.run") || strings.HasPrefix(a, "--test.run") {
			return true
		}
	}
	return false
}

// group is a set of scenarios that run one after another in one process.
type group struct {
	name, run string
	seeds     []uint64
}

// runGroups runs the suite as independent groups side by side, each a
// process of this test binary in a network namespace of its own (its own
// API server, agent ports, bridge and host probe set: nothing shared, so
// nothing collides), to keep the suite within its CI budget on a 2-core
// machine. Each group's output is printed whole when it ends. The seeds
// are chosen here (or taken from AMBIENT_CHAOS_SEEDS) and printed first.
func runGroups() int {
	seeds, err := parseSeeds(os.Getenv(seedsEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	if len(seeds) == 0 {
		seeds = newSeeds(6)
	}
	kill, zt := seeds, seeds[:1]
	if len(seeds) > 5 {
		kill, zt = seeds[:len(seeds)-1], seeds[len(seeds)-1:]
	}
	half := (len(kill) + 1) / 2
	groups := []group{
		{name: "soak", run: "^TestSoak$"},
		{name: "agent kills (1)", run: "^TestAgentKilled$", seeds: kill[:half]},
		{name: "agent kills (2)", run: "^TestAgentKilled$", seeds: kill[half:]},
		{name: "ztunnel restarts, API server outage, uninstall kills", run: "^(TestZtunnelRestarts|TestAPIServerOutage|TestUninstallKilled)$", seeds: zt},
	}
	fmt.Printf("chaos: agent-kill seeds %s, ztunnel seed %s (replay all: %s=%s)\n",
		joinSeeds(kill), joinSeeds(zt), seedsEnv, joinSeeds(seeds))
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	type result struct {
		g    group
		out  []byte
		code int
		took time.Duration
	}
	results := make(chan result, len(groups))
	var mu sync.Mutex
	var cmds []*exec.Cmd
	start := time.Now()
	for _, g := range groups {
		if len(g.seeds) == 0 && g.name != "soak" {
			continue
		}
		out, err := os.CreateTemp("", "achaos-out-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 2
		}
		_ = os.Remove(out.Name()) // unlinked: nothing to clean up
		args := append(append([]string{}, os.Args[1:]...), "-test.run="+g.run)
		env := []string{groupEnv + "=" + g.name}
		if len(g.seeds) > 0 {
			env = append(env, seedsEnv+"="+joinSeeds(g.seeds))
		}
		cmd, err := testnet.StartInOwnNetns(args, env, out, out)
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 2
		}
		mu.Lock()
		cmds = append(cmds, cmd)
		mu.Unlock()
		go func() {
			code := 0
			if err := cmd.Wait(); err != nil {
				code = 1
				if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() > 0 {
					code = ee.ExitCode()
				}
			}
			_, _ = out.Seek(0, 0)
			b, _ := io.ReadAll(out)
			_ = out.Close()
			results <- result{g: g, out: b, code: code, took: time.Since(start)}
		}()
	}
	code := 0
	var failures []string
	for range cmds {
		var r result
		select {
		case r = <-results:
		case s := <-sigs:
			mu.Lock()
			for _, c := range cmds {
				_ = c.Process.Signal(s) // each cleans up on the same signal
			}
			mu.Unlock()
			r = <-results
		}
		verdict := "ok"
		if r.code != 0 {
			verdict, code = "FAIL", 1
			failures = append(failures, failureLines(r.g.name, r.out)...)
		}
		fmt.Printf("=== chaos group %q (%s=%s): %s after %v\n%s\n", r.g.name, seedsEnv, joinSeeds(r.g.seeds), verdict, r.took.Round(time.Second), r.out)
	}
	// Repeated last: a CI log often shows only its end, where the groups'
	// own output ends with the agent's log.
	if len(failures) > 0 {
		fmt.Printf("chaos: what failed:\n%s\n", strings.Join(failures, "\n"))
	}
	fmt.Printf("chaos: %d groups in %v; seeds %s\n", len(cmds), time.Since(start).Round(time.Second), joinSeeds(seeds))
	return code
}

// testMessage is the first line of a test's message (Errorf, Fatalf,
// Logf), or a FAIL line.
var testMessage = regexp.MustCompile(`^\s*(--- FAIL: .*|[a-z_]+_test\.go:\d+: .*)$`)

// failureLines picks a failed group's test messages and FAIL lines, each
// cut short, at most 30.
func failureLines(group string, out []byte) []string {
	var lines []string
	for l := range strings.SplitSeq(string(out), "\n") {
		if !testMessage.MatchString(l) {
			continue
		}
		l = strings.TrimSpace(l)
		if len(l) > 300 {
			l = l[:300] + " ..."
		}
		lines = append(lines, "  ["+group+"] "+l)
	}
	if len(lines) > 30 {
		lines = lines[len(lines)-30:]
	}
	return lines
}

// parseSeeds reads a comma-separated seed list ("" is none).
func parseSeeds(s string) ([]uint64, error) {
	var out []uint64
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	for f := range strings.SplitSeq(s, ",") {
		v, err := strconv.ParseUint(strings.TrimSpace(f), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%s=%q: %w", seedsEnv, s, err)
		}
		out = append(out, v)
	}
	return out, nil
}

func joinSeeds(seeds []uint64) string {
	var out []string
	for _, s := range seeds {
		out = append(out, strconv.FormatUint(s, 10))
	}
	return strings.Join(out, ",")
}
