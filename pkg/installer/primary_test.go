package installer

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// ciliumConf is a single-plugin primary config as older Cilium releases
// wrote it (05-cilium.conf).
const ciliumConf = `{
  "cniVersion": "0.3.1",
  "name": "cilium",
  "type": "cilium-cni",
  "enable-debug": false
}
`

// convertedOK reports whether the .conf is gone and its .conflist is
// exactly conf converted and chained.
func (e *env) convertedOK(t testing.TB, base, conf string) func() error {
	want := mustChain(t, conf, base+".conf")
	return func() error {
		if _, err := os.Stat(e.path(base + ".conf")); err == nil {
			return errors.New(".conf still present")
		}
		b, err := os.ReadFile(e.path(base + ".conflist"))
		if err != nil {
			return err
		}
		if string(b) != want {
			return errors.New(".conflist is not the converted, chained .conf")
		}
		return nil
	}
}

// TestRunConfPrimaryRewrittenAndDeleted: a .conf primary is converted to
// the .conflist the runtime then picks; when the primary writes its .conf
// again (an agent restart), the new content is converted and chained and
// the list replaced; when the primary deletes its config (Cilium does
// when its agent stops) nothing is chained and the installer is not ready
// until the primary writes it again; an uninstall puts back the last .conf
// the primary wrote, byte for byte, and removes the list.
func TestRunConfPrimaryRewrittenAndDeleted(t *testing.T) {
	e := newEnv(t)
	e.write(t, "05-cilium.conf", ciliumConf, 0o644)
	i := e.installer(t, nil)
	run(t, i)
	waitFor(t, "conversion", e.convertedOK(t, "05-cilium", ciliumConf))
	waitFor(t, "ready", i.Check)

	rewritten := strings.Replace(ciliumConf, `"enable-debug": false`, `"enable-debug": true`, 1)
	e.write(t, "05-cilium.conf", rewritten, 0o644)
	waitFor(t, "the rewritten .conf converted and chained", e.convertedOK(t, "05-cilium", rewritten))

	if err := os.Remove(e.path("05-cilium.conflist")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "not ready without a primary", func() error {
		if err := i.Check(); !errors.Is(err, ErrNoPrimaryConfig) {
			return fmt.Errorf("Check: %v, want ErrNoPrimaryConfig", err)
		}
		return nil
	})
	if ents, _ := os.ReadDir(e.conf); len(ents) != 0 {
		t.Fatalf("the installer wrote a config with no primary: %v", ents)
	}
	e.write(t, "05-cilium.conf", rewritten, 0o644)
	waitFor(t, "converted again", e.convertedOK(t, "05-cilium", rewritten))
	waitFor(t, "ready again", i.Check)

	if err := i.Shutdown(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if got := e.read(t, "05-cilium.conf"); got != rewritten {
		t.Errorf("restored .conf:\n%s\nwant the primary's last one:\n%s", got, rewritten)
	}
	if _, err := os.Stat(e.path("05-cilium.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("the converted list is still there after the uninstall")
	}
}

// TestConversionKeepsTheRuntimesChoice: converting X.conf into
// X.conflist must not let a config that sorts between the two names
// become the one the runtime uses.
func TestConversionKeepsTheRuntimesChoice(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-a.conf", ciliumConf, 0o644)
	e.write(t, "10-a.conf.d.json", `{"cniVersion":"1.0.0","name":"b","type":"bridge"}`, 0o644)
	old := time.Now().Add(-time.Minute)
	for _, n := range []string{"10-a.conf", "10-a.conf.d.json"} {
		if err := os.Chtimes(e.path(n), old, old); err != nil {
			t.Fatal(err)
		}
	}
	i := e.installer(t, nil)
	err := i.Install(context.Background())
	if err == nil || !strings.Contains(err.Error(), "10-a.conf.d.json") || !strings.Contains(err.Error(), "refusing") {
		t.Fatalf("err %v, want a refusal naming the file that sorts between", err)
	}
	if e.read(t, "10-a.conf") != ciliumConf {
		t.Error("the .conf was touched")
	}
	if _, err := os.Stat(e.path("10-a.conflist")); !errors.Is(err, fs.ErrNotExist) {
		t.Error("a list was written")
	}
	// Naming the primary makes the order the operator's business.
	i2 := e.installer(t, func(c *Config) { c.PrimaryConfName = "10-a.conf" })
	if err := i2.Install(context.Background()); err != nil {
		t.Fatalf("with the primary named: %v", err)
	}
}

// TestRunExclusivePrimaryIsReported: a primary that rewrites its config
// without our entry whenever the directory changes (Cilium with
// cni.exclusive=true) gets the entry back every time, within the rewrite
// limit, and after the third removal within a minute the installer says
// so: once in the log, once to OnRefused, and in Check (not ready) until
// the primary has left the entry alone for a minute.
func TestRunExclusivePrimaryIsReported(t *testing.T) {
	e := newEnv(t)
	list := `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni"}]}`
	e.write(t, "05-cilium.conflist", list, 0o644)
	var mu sync.Mutex
	var refused []error
	i := e.installer(t, func(c *Config) {
		c.OnRefused = func(err error) { mu.Lock(); refused = append(refused, err); mu.Unlock() }
	})
	run(t, i)
	waitFor(t, "install", i.Check)
	for n := range contestedRemovals + 2 {
		wrote := time.Now()
		e.write(t, "05-cilium.conflist", list, 0o644)
		waitFor(t, fmt.Sprintf("re-chained after removal %d", n+1), e.chainedOK(t, "05-cilium.conflist", list))
		// The installer notes the removal just after its write, which
		// the file shows first: without this wait the last removal can
		// land after the episode's end below and open another.
		waitFor(t, fmt.Sprintf("removal %d noted", n+1), func() error {
			i.contestMu.Lock()
			defer i.contestMu.Unlock()
			if k := len(i.removals); k == 0 || i.removals[k-1].Before(wrote) {
				return errors.New("not yet")
			}
			return nil
		})
	}
	err := i.Check()
	if !errors.Is(err, ErrPrimaryContested) || !strings.Contains(err.Error(), "cni.exclusive=false") || !strings.Contains(err.Error(), "05-cilium.conflist") {
		t.Fatalf("Check: %v, want ErrPrimaryContested naming the file and Cilium's setting", err)
	}
	t.Logf("Check: %v", err)
	mu.Lock()
	if len(refused) != 1 || !errors.Is(refused[0], ErrPrimaryContested) {
		t.Errorf("OnRefused got %v, want one ErrPrimaryContested", refused)
	}
	mu.Unlock()
	if n := e.logs.count("primary CNI keeps removing our config entry"); n != 1 {
		t.Errorf("warned %d times, want once", n)
	}
	// A minute without removals ends it.
	if err := i.contestedNow(time.Now().Add(contestedWindow + time.Second)); err != nil {
		t.Errorf("a window after the last removal: %v", err)
	}
	if err := i.Check(); err != nil {
		t.Errorf("Check after the episode: %v", err)
	}
}

// TestPrimaryRestartsAreNotAContest: a primary that rewrites its config
// now and then (an agent restart) gets the entry back and is not
// reported: removals far apart do not count.
func TestPrimaryRestartsAreNotAContest(t *testing.T) {
	e := newEnv(t)
	i := e.installer(t, nil)
	now := time.Now()
	for n := range 5 {
		i.noteRemoval(e.path("10-x.conflist"), now.Add(time.Duration(n)*(contestedWindow/2+time.Second)))
	}
	if err := i.contestedNow(now.Add(3 * contestedWindow)); err != nil {
		t.Errorf("restarts taken for a contest: %v", err)
	}
	if n := e.logs.count("primary CNI keeps removing"); n != 0 {
		t.Errorf("warned %d times", n)
	}
	// Two bursts a while apart are two episodes, each told once, even
	// when no Check ended the first.
	burst := func(at time.Time) {
		for n := range contestedRemovals + 1 {
			i.noteRemoval(e.path("10-x.conflist"), at.Add(time.Duration(n)*time.Second))
		}
	}
	burst(now.Add(10 * contestedWindow))
	burst(now.Add(20 * contestedWindow))
	if n := e.logs.count("primary CNI keeps removing"); n != 2 {
		t.Errorf("two bursts warned %d times, want twice", n)
	}
}
