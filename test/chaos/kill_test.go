package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// seedsEnv replays chosen schedules: AMBIENT_CHAOS_SEEDS=1,2,3.
const seedsEnv = "AMBIENT_CHAOS_SEEDS"

// chaosSeeds are the seeds of this run: those in seedsEnv, else five new
// ones (printed, so any failure can be replayed).
func chaosSeeds(t *testing.T) []uint64 {
	t.Helper()
	seeds, err := parseSeeds(os.Getenv(seedsEnv))
	if err != nil {
		t.Fatal(err)
	}
	if len(seeds) == 0 {
		seeds = newSeeds(5)
	}
	return seeds
}

// newSeeds draws n seeds.
func newSeeds(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = rand.Uint64N(1_000_000)
	}
	return out
}

// killPending are the agent-kill checks waiting for fixes being made on
// other branches (see judge).
var killPending = pending{}

// TestAgentKilled is issue 12's first fault: the shipped agent is
// SIGKILLed at random points while 50 pod slots start and stop pods
// concurrently through the CNI chain in an ambient namespace (some pods
// opted out), a plain one (some pods enabled by their own label) and one
// whose label flips. The seed fixes the whole schedule: when the agent is
// killed (at random, and at random moments just after a label flip, while
// the flip's captures or releases run), how long it stays down, whether it
// is killed again while it restores, when the label flips, and how long
// each pod lives. Pods whose ADD fails are retried as kubelet does. After
// the last restart the node must settle to exactly the right state
// (world.verify), and every ADD that succeeded in the ambient namespace
// must have had the pod captured when it returned.
func TestAgentKilled(t *testing.T) {
	requireLong(t)
	seeds := chaosSeeds(t)
	var list []string
	for _, s := range seeds {
		list = append(list, strconv.FormatUint(s, 10))
	}
	t.Logf("agent-kill seeds: %s (replay with %s=%s)", strings.Join(list, ","), seedsEnv, strings.Join(list, ","))
	for i, seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Logf("seed %d (replay: %s=%d)", seed, seedsEnv, seed)
			killRun(t, seed, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(70 + i%50), 0, 0}), 16))
		})
	}
}

// killChurn is how long pods start and stop while the agent is killed.
const killChurn = 20 * time.Second

func killRun(t *testing.T, seed uint64, subnet netip.Prefix) {
	began := time.Now()
	n := newNode(t, nodeOptions{subnet: subnet})
	w := newWorld(n)
	rng := rand.New(rand.NewPCG(seed, 0x6b696c6c))
	amb := w.namespace("amb", ambient.DataplaneModeAmbient)
	plain := w.namespace("plain", "")
	flipMode := ""
	if rng.IntN(2) == 0 {
		flipMode = ambient.DataplaneModeAmbient
	}
	flip := w.namespace("flip", flipMode)
	w.stable, w.servedAtAdd = amb, true

	// The schedule, all from the seed.
	events := faultSchedule(rng, 3+rng.IntN(2), killChurn-2*time.Second, killChurn, 1500*time.Millisecond, 2500*time.Millisecond)

	// Pods must start in the end, whatever the agent went through.
	ctx, cancel := context.WithTimeout(context.Background(), killChurn+3*time.Minute)
	defer cancel()
	start := time.Now()
	wait := w.churn(ctx, seed, 50, killChurn, func(slot int) (string, string) {
		switch {
		case slot < 20:
			if slot%5 == 4 {
				return amb, "none" // opted out
			}
			return amb, ""
		case slot < 35:
			return flip, ""
		case slot%3 == 0:
			return plain, ambient.DataplaneModeAmbient // enabled by its own label
		}
		return plain, ""
	})

	log := w.play(ctx, t, start, events, flip, func(say func(string, ...any)) {
		n.killAgent()
		down := time.Duration(rng.Int64N(int64(1500 * time.Millisecond)))
		say("SIGKILL, down %v", down.Round(time.Millisecond))
		time.Sleep(down)
		n.startAgent()
		if rng.IntN(3) == 0 {
			// Again, while it restores and comes up.
			time.Sleep(time.Duration(rng.Int64N(int64(800 * time.Millisecond))))
			n.killAgent()
			down = time.Duration(rng.Int64N(int64(500 * time.Millisecond)))
			say("SIGKILL during start, down %v", down.Round(time.Millisecond))
			time.Sleep(down)
			n.startAgent()
		}
	})
	t.Logf("schedule:\n  %s", strings.Join(log, "\n  "))
	for _, err := range wait() {
		t.Errorf("pod churn: %v", err)
	}
	n.waitReady(waitReadyTimeout)
	churned := time.Since(start)
	r := w.settle(ctx, 90*time.Second, killPending)
	t.Logf("%s; churn %v, settled in %v, run %v; the agent was started %d times",
		w.summary(), churned.Round(time.Second), (time.Since(start) - churned).Round(time.Second), time.Since(began).Round(time.Second), n.agentStarts())
	judge(t, r, killPending)
	if crashed := n.crashes(); len(crashed) > 0 {
		t.Errorf("the agent exited on its own %d times:\n%s", len(crashed), strings.Join(crashed, "\n"))
	}
}

// modeOf is a namespace's dataplane-mode label as last set.
func (w *world) modeOf(ns string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.nsLabel[ns]
}
