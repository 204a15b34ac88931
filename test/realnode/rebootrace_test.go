//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/installer"
)

// The reboot race: a primary CNI whose agent writes its conflist again at
// boot, without our entry, before our agent is back (k3s writes flannel's
// at every start; Calico's and Cilium's agents rewrite theirs), while
// kubelet recreates the sandboxes of the pods bound to the node. With the
// owned conflist (cni.ownedConfig) the runtime keeps loading ours, so
// every sandbox runs the plugin: it waits (code 11) until the agent is
// back or is captured at ADD. Figures go to docs/reliability.md.

// raceCycles is how many reboots the race is run with the owned
// conflist; folderCycles how many more with our entry in the primary
// network's folder (cni.chainInNetworkFolder); chainedCycles how many
// more, chained, to show the race.
const (
	raceCycles    = 20
	folderCycles  = 5
	chainedCycles = 2
)

// raceMode is where our entry is while the primary rewrites its file.
type raceMode int

const (
	raceOwned   raceMode = iota // our own conflist, sorting first
	raceFolder                  // the primary network's folder
	raceChained                 // the primary's own file: the race shows
)

// bootKey is the top-level key the fake primary agent stamps into its
// conflist at each boot: libcni passes no top-level key to any plugin,
// so the network is the same and each rewrite is told apart.
const bootKey = "x-primary-boot"

// primaryBoot is the fake primary agent at boot: it writes its conflist
// again as it has it (its original, without our entry), stamped with the
// boot number, by rename as the primaries' agents do.
func primaryBoot(n *Node, boot int) error {
	var conf map[string]any
	if err := json.Unmarshal(n.CNIConfOriginal, &conf); err != nil {
		return err
	}
	conf[bootKey] = boot
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(n.CNIConfFile), ".primary-boot.tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, n.CNIConfFile)
}

// confState is what one conflist holds: the primary's boot stamp and
// whether the chain the runtime runs for it has our plugin, read as
// containerd 2.4 reads it (libcni 1.3: the list's plugins, then its
// network's folder).
func confState(path string) (boot int, ours bool, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false, err
	}
	var conf struct {
		Boot int `json:"x-primary-boot"`
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		return 0, false, fmt.Errorf("%s: %w", path, err)
	}
	list, err := libcni.ConfListFromFile(path)
	if err != nil {
		return 0, false, err
	}
	return conf.Boot, slices.ContainsFunc(list.Plugins, func(p *libcni.PluginConfig) bool { return p.Network.Type == installer.DefaultPluginName }), nil
}

// networkName is a conflist's network name, which names its folder.
func networkName(t *testing.T, conf []byte) string {
	t.Helper()
	var l struct{ Name string }
	if err := json.Unmarshal(conf, &l); err != nil || l.Name == "" {
		t.Fatalf("the primary's conflist has no network name (%v)", err)
	}
	return l.Name
}

// runtimeConf is the conflist the runtime loads: the lexically first
// config file of the conf dir (every file there loads).
func runtimeConf(n *Node) (string, error) { return runtimeConfIn(n.CNIConfDir) }

// runtimeConfIn is runtimeConf for a CNI config directory.
func runtimeConfIn(dir string) (string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		switch filepath.Ext(e.Name()) {
		case ".conf", ".conflist", ".json":
			return filepath.Join(dir, e.Name()), nil
		}
	}
	return "", fmt.Errorf("no config in %s", dir)
}

// inStepWatch polls a conflist from the primary's rewrite on; stop
// returns when it first held the rewrite's boot stamp and our entry (the
// window's end), or zero if it did not.
func inStepWatch(path string, boot int) (stop func() time.Time) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan time.Time, 1)
	go func() { // owner: stop, which cancels and waits
		var at time.Time
		defer func() { done <- at }()
		for ctx.Err() == nil {
			if b, ours, err := confState(path); err == nil && b == boot && ours {
				at = time.Now()
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	return func() time.Time {
		// Called once the file is in step: the watch sees it on its next
		// look, unless it never will (a failed cycle).
		select {
		case at := <-done:
			cancel()
			return at
		case <-time.After(5 * time.Second):
			cancel()
			return <-done
		}
	}
}

// sandboxesBefore counts the ready and not-ready sandboxes of the ambient
// namespace the runtime created before t.
func (l *life) sandboxesBefore(ctx context.Context, t time.Time) (int, error) {
	out, err := l.n.crictl(ctx, "pods", "--namespace", lifeNS, "-o", "json")
	if err != nil {
		return 0, err
	}
	var list struct {
		Items []struct {
			CreatedAt string
			Metadata  struct{ Namespace string }
		}
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		return 0, err
	}
	c := 0
	for _, it := range list.Items {
		ns, err := strconv.ParseInt(it.CreatedAt, 10, 64)
		if err != nil || it.Metadata.Namespace != lifeNS {
			continue
		}
		if time.Unix(0, ns).Before(t) {
			c++
		}
	}
	return c, nil
}

// refusals counts the sandbox attempts of a pod the plugin refused since
// since because it must be captured and the agent could not yet (kubelet's
// FailedCreatePodSandBox events).
func (l *life) refusals(ctx context.Context, p *corev1.Pod, since time.Time) (int, error) {
	evs, err := l.n.PodEvents(ctx, p.Namespace, p.Name)
	if err != nil {
		return 0, err
	}
	c := 0
	for _, ev := range evs {
		// Events repeat into one (Count); one first seen before this
		// reboot is a previous cycle's.
		if ev.Reason == "FailedCreatePodSandBox" && strings.Contains(ev.Message, "must be captured") && !ev.FirstTimestamp.Time.Before(since.Truncate(time.Second)) {
			c += int(max(ev.Count, 1))
		}
	}
	return c, nil
}

// stopTraffic stops the traffic, if it runs.
func (l *life) stopTraffic() {
	if l.traffic != nil {
		l.traffic.Stop()
		l.traffic = nil
	}
}

// raceCycle is what one reboot showed.
type raceCycle struct {
	window                 time.Duration // the primary's rewrite until the owned conflist held it
	windowSandboxes        int           // ambient sandboxes the runtime created in the window
	refused                int           // sandbox attempts the plugin refused (must be captured)
	back                   time.Duration // the reboot until every ambient pod was Ready again
	samples, uncaptured    int
	startedUncaptured      int
	trafficOK, trafficFail int
}

func TestRealNodeRebootRace(t *testing.T) {
	begin := time.Now() // includes waiting for the machine's real node
	e := startAgentNode(t, "--set", "cni.ownedConfig=true")
	l := &life{e2e: e}
	ctx := context.Background()
	if filepath.Dir(l.n.CNIConfFile) != l.n.CNIConfDir {
		t.Fatalf("the primary conflist %s is not in the runtime's conf dir %s", l.n.CNIConfFile, l.n.CNIConfDir)
	}
	ownedPath := filepath.Join(l.n.CNIConfDir, installer.DefaultOwnedConfName)
	// Installed: the runtime loads our file, the primary's is untouched.
	if err := l.n.Poll(ctx, "the owned conflist is the runtime's", func(context.Context) (bool, error) {
		p, err := runtimeConf(l.n)
		if err != nil {
			return false, err
		}
		if _, ours, err := confState(p); err != nil || p != ownedPath || !ours {
			return false, fmt.Errorf("the runtime loads %s (ours: %v, %v)", p, ours, err)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(l.n.CNIConfFile); err != nil || string(b) != string(l.n.CNIConfOriginal) {
		t.Fatalf("the primary's conflist was edited (%v):\n%s", err, b)
	}
	l.namespace(t, sinkNS, false)
	l.namespace(t, lifeNS, true)
	l.startSink(t)
	for _, name := range []string{"srv", "a1", "a2"} {
		l.mustCaptured(t, l.startAmbient(t, name))
	}
	t.Cleanup(l.stopTraffic)
	figure(t, "reboot-race-setup-seconds", time.Since(begin).Round(100*time.Millisecond).Seconds())

	cyclesBegin := time.Now()
	var cycles []raceCycle
	for boot := 1; boot <= raceCycles && !t.Failed(); boot++ {
		cycles = append(cycles, l.raceOnce(t, boot, ownedPath, raceOwned))
	}
	cyclesTook := time.Since(cyclesBegin)

	var windows []time.Duration
	uncaptured, started, refused, inWindow := 0, 0, 0, 0
	for n, c := range cycles {
		t.Logf("FIGURE reboot-race-cycle %d window-ms %d sandboxes-in-window %d refused %d back-s %.1f samples %d uncaptured %d started-uncaptured %d traffic-ok %d traffic-failed %d",
			n+1, c.window.Milliseconds(), c.windowSandboxes, c.refused, c.back.Seconds(), c.samples, c.uncaptured, c.startedUncaptured, c.trafficOK, c.trafficFail)
		windows = append(windows, c.window)
		uncaptured += c.uncaptured
		started += c.startedUncaptured
		refused += c.refused
		inWindow += c.windowSandboxes
	}
	slices.Sort(windows)
	if len(windows) > 0 {
		figure(t, "reboot-race-window-ms-min-median-max", fmt.Sprintf("%d %d %d", windows[0].Milliseconds(), windows[len(windows)/2].Milliseconds(), windows[len(windows)-1].Milliseconds()))
	}
	figure(t, "reboot-race-cycles", len(cycles))
	figure(t, "reboot-race-ambient-pods-seen-uncaptured", uncaptured)
	figure(t, "reboot-race-pods-started-uncaptured", started)
	figure(t, "reboot-race-sandboxes-in-window", inWindow)
	figure(t, "reboot-race-sandbox-attempts-refused", refused)
	figure(t, "reboot-race-cycles-seconds", cyclesTook.Round(100*time.Millisecond).Seconds())
	figure(t, "reboot-race-seconds-per-cycle", (cyclesTook / time.Duration(max(len(cycles), 1))).Round(100*time.Millisecond).Seconds())
	if len(cycles) < raceCycles && !t.Failed() {
		t.Errorf("%d reboot cycles, want %d", len(cycles), raceCycles)
	}

	// Our entry in the primary network's folder: the owned conflist goes,
	// the primary's file stays as its agent writes it, and its rewrites at
	// boot leave the runtime's chain with our plugin.
	l.stopTraffic()
	if err := l.n.InstallAgent(ctx, "upgrade", ImageTag, "--set", "cni.ownedConfig=false", "--set", "cni.chainInNetworkFolder=true"); err != nil {
		t.Fatal(err)
	}
	folderFile := filepath.Join(l.n.CNIConfDir, networkName(t, l.n.CNIConfOriginal), "zz-"+installer.DefaultPluginName+".conf")
	if err := l.n.Poll(ctx, "our entry in the primary network's folder, the owned conflist gone", func(context.Context) (bool, error) {
		if _, err := os.Stat(ownedPath); !os.IsNotExist(err) {
			return false, fmt.Errorf("the owned conflist is still there (%v)", err)
		}
		if _, err := os.Stat(folderFile); err != nil {
			return false, err
		}
		if b, err := os.ReadFile(l.n.CNIConfFile); err != nil || strings.Contains(string(b), installer.DefaultPluginName) {
			return false, fmt.Errorf("the primary's conflist holds our entry (%v)", err)
		}
		if _, ours, err := confState(l.n.CNIConfFile); err != nil || !ours {
			return false, fmt.Errorf("the runtime's chain lacks our plugin (%v)", err)
		}
		// What containerd itself loaded: install-cni made it reload.
		if chained, err := l.runtimeChains(ctx); err != nil || !chained {
			return false, fmt.Errorf("containerd's loaded config runs our plugin: %v (%v)", chained, err)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	folderBegin, folder, folderBad := time.Now(), 0, 0
	for boot := len(cycles) + 1; boot <= len(cycles)+folderCycles && !t.Failed(); boot++ {
		c := l.raceOnce(t, boot, ownedPath, raceFolder)
		folder++
		folderBad += c.uncaptured + c.startedUncaptured
		t.Logf("FIGURE reboot-race-folder-cycle %d window-ms %d sandboxes-in-window %d refused %d back-s %.1f samples %d uncaptured %d started-uncaptured %d",
			folder, c.window.Milliseconds(), c.windowSandboxes, c.refused, c.back.Seconds(), c.samples, c.uncaptured, c.startedUncaptured)
	}
	figure(t, "reboot-race-folder-cycles", folder)
	figure(t, "reboot-race-folder-pods-uncaptured", folderBad)
	figure(t, "reboot-race-folder-seconds", time.Since(folderBegin).Round(100*time.Millisecond).Seconds())

	// The same race chained, for comparison: the folder's entry goes
	// with the option, and the primary's rewrite at boot drops our entry
	// until the agent is back. Measured, not asserted.
	l.stopTraffic()
	if err := l.n.InstallAgent(ctx, "upgrade", ImageTag, "--set", "cni.ownedConfig=false", "--set", "cni.chainInNetworkFolder=false"); err != nil {
		t.Fatal(err)
	}
	if err := l.n.Poll(ctx, "chained into the primary's conflist, the owned one gone", func(context.Context) (bool, error) {
		if _, err := os.Stat(ownedPath); !os.IsNotExist(err) {
			return false, fmt.Errorf("the owned conflist is still there (%v)", err)
		}
		if _, err := os.Stat(folderFile); !os.IsNotExist(err) {
			return false, fmt.Errorf("our entry is still in the folder (%v)", err)
		}
		return true, pluginInstalled(l.n)
	}); err != nil {
		t.Fatal(err)
	}
	chained := 0
	for boot := len(cycles) + folder + 1; boot <= len(cycles)+folder+chainedCycles && !t.Failed(); boot++ {
		c := l.raceOnce(t, boot, ownedPath, raceChained)
		chained++
		t.Logf("FIGURE reboot-race-chained-cycle %d window-ms %d sandboxes-in-window %d back-s %.1f samples %d uncaptured %d started-uncaptured %d",
			chained, c.window.Milliseconds(), c.windowSandboxes, c.back.Seconds(), c.samples, c.uncaptured, c.startedUncaptured)
	}

	// An uninstall takes our entry away; the primary's file is as its
	// agent last wrote it.
	l.stopTraffic()
	if err := l.n.UninstallAgent(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(ownedPath); !os.IsNotExist(err) {
		t.Errorf("the owned conflist is still there after helm uninstall (%v)", err)
	}
	if boot, ours, err := confState(l.n.CNIConfFile); err != nil || ours || boot != len(cycles)+folder+chained {
		t.Errorf("the primary's conflist after uninstall: boot %d (want %d), ours %v, %v", boot, len(cycles)+folder+chained, ours, err)
	}
	figure(t, "reboot-race-total-seconds", time.Since(begin).Round(time.Second).Seconds())
}

// raceOnce is one reboot cycle: traffic runs until the node goes down;
// while it is down the fake primary agent writes its conflist again
// without our entry; the node comes back and kubelet recreates every
// sandbox while a sampler checks every ready ambient sandbox for its
// rules; then every pod is checked captured and started captured, and
// traffic is proved through the stand-in again. Chained, the race is only
// measured: pods that start uncaptured are counted, not failed.
func (l *life) raceOnce(t *testing.T, boot int, ownedPath string, mode raceMode) raceCycle {
	t.Helper()
	ctx := context.Background()
	var c raceCycle
	live := l.livePods(t)
	before := map[string]string{}
	for _, p := range live {
		before[p.Name] = p.Status.ContainerStatuses[0].ContainerID
	}
	if l.traffic != nil {
		// Some traffic through the stand-in before the node goes down.
		if err := l.n.Poll(ctx, "traffic before the reboot", func(context.Context) (bool, error) {
			if d := l.traffic.Counts(); d.LoopOK < 5 || d.HeldRequests < heldConns {
				return false, fmt.Errorf("%d loop requests, %d held", d.LoopOK, d.HeldRequests)
			}
			return true, nil
		}); err != nil {
			t.Errorf("boot %d: %v", boot, err)
		}
		d := l.traffic.Stop()
		c.trafficOK, c.trafficFail = d.LoopOK+d.HeldRequests, d.LoopFailed+d.Broken
		l.traffic = nil
		if c.trafficFail > 0 {
			t.Errorf("boot %d: before the reboot %d requests failed, %d held connections broke: %v", boot, d.LoopFailed, d.Broken, d.Listed())
		}
	}
	var (
		stopSampling func() (int, int, []string)
		stopWatch    func() time.Time
		rewroteAt    time.Time
		bootErr      error
	)
	watched := ownedPath
	if mode != raceOwned {
		watched = l.n.CNIConfFile
	}
	down := time.Now()
	err := l.n.Reboot(ctx, func() {
		stopSampling = l.sampleCapture()
		if bootErr = primaryBoot(l.n, boot); bootErr != nil {
			return
		}
		rewroteAt = time.Now()
		stopWatch = inStepWatch(watched, boot)
		if b, err := os.ReadFile(l.n.CNIConfFile); err != nil || strings.Contains(string(b), installer.DefaultPluginName) {
			bootErr = fmt.Errorf("the fake primary's conflist holds our entry (%v)", err)
			return
		}
		if mode == raceChained {
			return
		}
		// The primary dropped us from its own file; the runtime still
		// loads a chain with our plugin: the owned conflist's, or the
		// primary's with its folder.
		p, err := runtimeConf(l.n)
		if err == nil && p != watched {
			err = fmt.Errorf("the runtime would load %s", p)
		}
		if _, ours, cerr := confState(watched); err == nil && (cerr != nil || !ours) {
			err = fmt.Errorf("the runtime's chain from %s lost our plugin (%v)", watched, cerr)
		}
		if err != nil {
			bootErr = fmt.Errorf("at boot, before our agent: %w", err)
		}
	})
	if err == nil {
		err = bootErr
	}
	if err != nil {
		if stopSampling != nil {
			stopSampling()
		}
		if stopWatch != nil {
			stopWatch()
		}
		t.Fatalf("boot %d: %v", boot, err)
	}
	for name, old := range before {
		if err := l.waitRestarted(ctx, lifeNS, name, old); err != nil {
			t.Errorf("boot %d: %v", boot, err)
		}
	}
	c.back = time.Since(down)
	if err := l.n.Poll(ctx, "our entry in step with the primary's boot rewrite", func(context.Context) (bool, error) {
		if b, ours, err := confState(watched); err != nil || b != boot || !ours {
			return false, fmt.Errorf("boot stamp %d (want %d), ours %v, %v", b, boot, ours, err)
		}
		return true, nil
	}); err != nil {
		t.Errorf("boot %d: %v", boot, err)
	}
	inStep := stopWatch()
	if inStep.IsZero() {
		t.Fatalf("boot %d: the window's end was not seen", boot)
	}
	c.window = inStep.Sub(rewroteAt)
	if c.windowSandboxes, err = l.sandboxesBefore(ctx, inStep); err != nil {
		t.Errorf("boot %d: %v", boot, err)
	}
	var bad []string
	c.samples, _, bad = stopSampling()
	c.uncaptured = len(bad)
	if len(bad) > 0 && mode == raceChained {
		t.Logf("boot %d, chained: ambient pods ran uncaptured:\n%s", boot, strings.Join(bad, "\n"))
	} else if len(bad) > 0 {
		t.Errorf("boot %d: ambient pods ran uncaptured:\n%s", boot, strings.Join(bad, "\n"))
	}
	for name := range before {
		p := l.pod(t, name)
		l.mustCaptured(t, p)
		if err := l.n.Poll(ctx, name+"'s hello", func(ctx context.Context) (bool, error) {
			n, err := l.hellos(ctx, "/hello-"+name)
			return n > 0, err
		}); err != nil {
			t.Errorf("boot %d: %v", boot, err)
		} else if !l.startedCaptured(t, p) {
			c.startedUncaptured++
			if mode != raceChained {
				t.Errorf("boot %d: %s started uncaptured: its hello at start bypassed the stand-in", boot, name)
			}
		}
		r, err := l.refusals(ctx, p, down)
		if err != nil {
			t.Errorf("boot %d: %v", boot, err)
		}
		c.refused += r
	}
	// Traffic again, proved through the stand-in; it runs until the next
	// reboot takes the pods down.
	l.startTraffic(t)
	return c
}
