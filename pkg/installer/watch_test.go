package installer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// chainedOK reports whether name holds exactly the chained bridge list.
func (e *env) chainedOK(t testing.TB, name, primary string) func() error {
	want := mustChain(t, primary, "x.conflist")
	return func() error {
		b, err := os.ReadFile(e.path(name))
		if err != nil {
			return err
		}
		if string(b) != want {
			return errors.New("config not chained yet")
		}
		return nil
	}
}

func TestRunRestoresAfterPrimaryRewrites(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	var hooked atomic.Uint64
	i := e.installer(t, func(c *Config) { c.OnReinstall = func() { hooked.Add(1) } })
	run(t, i)
	waitFor(t, "initial install", i.Check)

	t.Run("overwrite in place", func(t *testing.T) {
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		d := waitFor(t, "restore after overwrite", e.chainedOK(t, "10-bridge.conflist", bridgeList))
		t.Logf("restored %v after an in-place overwrite", d)
	})
	t.Run("replace by rename", func(t *testing.T) {
		tmp := filepath.Join(e.conf, ".primary-tmp")
		if err := os.WriteFile(tmp, []byte(bridgeList), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, e.path("10-bridge.conflist")); err != nil {
			t.Fatal(err)
		}
		d := waitFor(t, "restore after rename", e.chainedOK(t, "10-bridge.conflist", bridgeList))
		t.Logf("restored %v after a replace by rename", d)
	})
	t.Run("delete and recreate", func(t *testing.T) {
		if err := os.Remove(e.path("10-bridge.conflist")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // a gap, as a restarting primary leaves
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		d := waitFor(t, "restore after recreate", e.chainedOK(t, "10-bridge.conflist", bridgeList))
		t.Logf("restored %v after delete and recreate", d)
	})
	t.Run("primary changes its config", func(t *testing.T) {
		// New content from the primary must win; we only re-add ourselves.
		changed := bridgeList[:len(bridgeList)-2] + ",\n  \"x-new\": 1\n}\n"
		e.write(t, "10-bridge.conflist", changed, 0o644)
		waitFor(t, "chain into the new content", e.chainedOK(t, "10-bridge.conflist", changed))
	})
	t.Run("binary deleted", func(t *testing.T) {
		if err := os.Remove(filepath.Join(e.bin, testType)); err != nil {
			t.Fatal(err)
		}
		d := waitFor(t, "binary restore", e.binaryOK)
		t.Logf("binary restored %v after deletion", d)
	})
	t.Run("binary overwritten", func(t *testing.T) {
		if err := os.WriteFile(filepath.Join(e.bin, testType), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "binary restore", e.binaryOK)
	})
	// The counter moves just after the rename the checks above see.
	waitFor(t, "reinstall count", func() error {
		if st := i.Stats(); st.Reinstalls < 6 || st.BinaryCopies != 3 || hooked.Load() != st.Reinstalls {
			return fmt.Errorf("want a reinstall per repair: %+v, hook saw %d", st, hooked.Load())
		}
		return nil
	})
}

// TestRunRepairsAWriteRightAfterItsCopy: a writer that overwrites the
// binary just after our copy landed, before the pass that made it
// returned, is not taken for our copy (the pass once stamped whatever it
// found at the path then, and no later pass looked at the content again).
func TestRunRepairsAWriteRightAfterItsCopy(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	var once sync.Once
	i.testHookBinaryCopied = func() {
		once.Do(func() {
			if err := os.WriteFile(filepath.Join(e.bin, testType), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
				t.Error(err)
			}
		})
	}
	run(t, i)
	waitFor(t, "binary restore", e.binaryOK)
	waitFor(t, "second copy counted", func() error {
		if st := i.Stats(); st.BinaryCopies != 2 {
			return fmt.Errorf("want the first copy and its repair: %+v", st)
		}
		return nil
	})
}

// TestRunReschedulesThrottledRepair: a repair the rewrite limit holds back
// runs once the limit allows, with no further event and no resync.
func TestRunReschedulesThrottledRepair(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, func(c *Config) {
		// One rewrite now, the next one 2s later: the first pass copies the
		// binary, finds no token left for the config (its next step) and
		// must come back for it on its own.
		c.MaxRewritesPerSecond, c.RewriteBurst, c.ResyncInterval = 0.5, 1, time.Hour
	})
	run(t, i)
	waitFor(t, "install after a throttled pass", i.Check)
	if st := i.Stats(); st.Throttled == 0 {
		t.Errorf("no pass was throttled: %+v", st)
	}
}

func TestRunWaitsForPrimary(t *testing.T) {
	e := newEnv(t)
	i := e.installer(t, nil)
	run(t, i)
	// Let Run make several passes (binary events, resync) with no config.
	waitFor(t, "binary install", e.binaryOK)
	// Non-config files come and go meanwhile.
	for n := range 5 {
		e.write(t, fmt.Sprintf("notes-%d.txt", n), "x", 0o644)
	}
	time.Sleep(300 * time.Millisecond)
	if i.Ready() {
		t.Fatal("ready without a primary config")
	}
	e.write(t, "05-cilium.conflist", `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni"}]}`, 0o644)
	waitFor(t, "chain into the new primary", i.Check)
	if n := e.logs.count("waiting for a primary CNI config"); n != 1 {
		t.Errorf("logged waiting %d times, want once", n)
	}
}

func TestRunFollowsPrimaryFileChange(t *testing.T) {
	e := newEnv(t)
	e.write(t, "20-flannel.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	run(t, i)
	waitFor(t, "install", i.Check)
	// A new primary appears lexically first: the runtime switches to it, so must we.
	e.write(t, "05-calico.conflist", bridgeList, 0o644)
	waitFor(t, "chain into the new first file", e.chainedOK(t, "05-calico.conflist", bridgeList))
	// A .conf dropped in even earlier is converted.
	e.write(t, "01-single.conf", `{"cniVersion":"1.0.0","name":"s","type":"ptp"}`, 0o644)
	waitFor(t, "convert the .conf", func() error {
		if _, err := os.Stat(e.path("01-single.conf")); err == nil {
			return errors.New(".conf still present")
		}
		return i.Check()
	})
}

func TestRunSurvivesConfDirRecreation(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	run(t, i)
	waitFor(t, "install", i.Check)
	if err := os.RemoveAll(e.conf); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if err := os.MkdirAll(e.conf, 0o755); err != nil {
		t.Fatal(err)
	}
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	waitFor(t, "restore in the recreated dir", e.chainedOK(t, "10-bridge.conflist", bridgeList))
}

func TestRunPrimaryInALoopDoesNotMakeUsSpin(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	const rate, burst = 2.0, 5
	i := e.installer(t, func(c *Config) { c.MaxRewritesPerSecond, c.RewriteBurst = rate, burst })
	run(t, i)
	waitFor(t, "install", i.Check)
	before := i.Stats()

	// A misbehaving primary rewrites its file without us as fast as it can.
	start := time.Now()
	writes := 0
	for time.Since(start) < 2*time.Second {
		e.write(t, "10-bridge.conflist", bridgeList, 0o644)
		writes++
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(start)
	after := i.Stats()
	ours := after.ConfigWrites - before.ConfigWrites
	bound := uint64(burst + rate*elapsed.Seconds() + 1)
	t.Logf("primary wrote %d times in %v; we rewrote %d times (bound %d), throttled %d passes",
		writes, elapsed.Round(time.Millisecond), ours, bound, after.Throttled-before.Throttled)
	if ours > bound {
		t.Errorf("rewrote %d times in %v, bound is %d", ours, elapsed, bound)
	}
	// Catching the primary mid-write must not read as "no config" and
	// flood the log (one may slip through if the writer stalls between
	// truncate and write for longer than settleTime on a loaded machine).
	if n := e.logs.count("waiting for a primary CNI config"); n > 1 {
		t.Errorf("logged waiting %d times during the loop", n)
	}
	// Once the primary stops, our entry comes back.
	waitFor(t, "restore after the loop ends", e.chainedOK(t, "10-bridge.conflist", bridgeList))
}

func TestShutdownWhileRunning(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(t, nil)
	run(t, i)
	waitFor(t, "install", i.Check)
	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	// The watcher sees our own removals; it must not put anything back.
	time.Sleep(500 * time.Millisecond)
	if got := e.read(t, "10-bridge.conflist"); got != bridgeList {
		t.Errorf("config after shutdown:\n%s", got)
	}
	if e.binaryOK() == nil {
		t.Error("binary came back after shutdown")
	}
}

// BenchmarkRestoreLatency measures the time from a primary CNI rewriting
// its config (dropping our entry) until our entry is back, with the
// default debounce. The rate limit is lifted so every iteration measures
// the watch path, not the limiter.
func BenchmarkRestoreLatency(b *testing.B) {
	e := newEnv(b)
	e.write(b, "10-bridge.conflist", bridgeList, 0o644)
	i := e.installer(b, func(c *Config) { c.MaxRewritesPerSecond, c.RewriteBurst = 1e6, 1e6 })
	run(b, i)
	waitFor(b, "install", i.Check)
	ok := e.chainedOK(b, "10-bridge.conflist", bridgeList)
	var total time.Duration
	b.ResetTimer()
	for b.Loop() {
		start := time.Now()
		e.write(b, "10-bridge.conflist", bridgeList, 0o644)
		for ok() != nil {
			time.Sleep(200 * time.Microsecond)
			if time.Since(start) > eventually {
				b.Fatal("not restored")
			}
		}
		total += time.Since(start)
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/restore")
}
