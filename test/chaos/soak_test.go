package chaos

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	cnitypes "github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/scrape"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

const (
	// soakCycles is issue 12's count of add/delete cycles through the
	// chain, after soakWarmup cycles that bring the agent to its working
	// size.
	soakCycles = 5000
	soakWarmup = 100
	// soakWorkers run cycles side by side, each on its own pods.
	soakWorkers = 4
)

// Soak tolerances: what the agent may legitimately hold more after 5,000
// cycles than after the warm-up (an HTTP/2 stream, a timer, the Go heap's
// own slack), far below what anything leaked per cycle would add (5,000
// descriptors, goroutines or netns handles; at least 5,000 times a small
// allocation).
const (
	soakFDSlack        = 4
	soakGoroutineSlack = 10
	soakRSSSlack       = 16 << 20 // bytes
	soakHeapSlack      = 8 << 20  // bytes
)

// TestSoak is the soak: 5,000 CNI ADD/DEL cycles through the chain
// (bridge, host-local, the shipped plugin) for pods of an ambient
// namespace (captured at ADD, released at DEL) and of a plain one, four at
// a time. Afterwards the agent's descriptors, goroutines, resident and Go
// heap memory are back at what they were after the warm-up (within the
// tolerances above), every cycle's pod started (an ADD failed "try again
// later" gets a new sandbox, as kubelet gives one: counted, printed), and
// nothing is left anywhere:
// no probe-set entry, ztunnel workload, held netns, agent state, spooled
// DEL, veth on the bridge or IP reservation. The pod objects outlive their
// sandboxes here, and a CNI DEL makes no API request (docs/deploy.md,
// "CNI DEL"): a pod's annotation waits for its next sandbox's ADD or its
// object's deletion, so an ambient pod may still read "enabled" (never
// anything else) and a plain pod nothing.
func TestSoak(t *testing.T) {
	requireLong(t)
	n := newNode(t, nodeOptions{subnet: netip.MustParsePrefix("10.122.0.0/16")})
	w := newWorld(n)
	amb := w.namespace("amb", ambient.DataplaneModeAmbient)
	plain := w.namespace("plain", "")
	// No budget of its own: at a load of 30 the cycles took 17 minutes,
	// and a fixed 20-minute budget failed the checks after them.
	ctx := runContext(t)

	// Pod objects, each worker its own: a cycle is one sandbox of one of
	// them, as when kubelet recreates a pod's sandbox.
	var pods [soakWorkers][]*corev1.Pod
	for i := range 32 {
		ns := amb
		if i%4 == 3 {
			ns = plain
		}
		obj, err := n.kube.Create(ctx, podObject(ns, fmt.Sprintf("soak-%02d", i), ""))
		if err != nil {
			t.Fatal(err)
		}
		pods[i%soakWorkers] = append(pods[i%soakWorkers], obj)
	}

	s := &soaker{n: n, w: w, conf: n.kube.Conf, cni: n.kube.CNI}
	start := time.Now()
	s.run(ctx, t, pods, soakWarmup)
	s.requireTime(ctx, t, "the warm-up", soakWarmup)
	if t.Failed() {
		return
	}
	n.idle(time.Minute)
	base, err := n.usage()
	if err != nil {
		t.Fatal(err)
	}
	// The tables' baseline is taken at rest, as their last sample is: no
	// pod captured, the warm-up's last sandboxes gone. The gauge is
	// sampled every few seconds, so right after idle it may still show
	// the last cycle's pod captured and its released-sandbox mark not yet
	// there; compared with that, the rest after the cycles read as one
	// more mark (released 23 -> 24), the flake this wait removes.
	baseTables, atRest := n.trackedPodsUntil(t, func(tables map[string]float64) bool {
		return tables["state"] == 0 && tables["records"] == 0
	})
	if !atRest {
		t.Fatalf("after the warm-up the agent still holds pods: %v", baseTables)
	}
	t.Logf("after %d warm-up cycles (%v): agent %s", soakWarmup, time.Since(start).Round(time.Second), base)

	start = time.Now()
	s.run(ctx, t, pods, soakCycles)
	s.requireTime(ctx, t, "the cycles", soakCycles)
	took := time.Since(start)
	n.idle(time.Minute)
	after, err := n.usage()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after %d cycles (%v, %.1f per second, %d ambient): agent %s", soakCycles, took.Round(time.Second),
		float64(soakCycles)/took.Seconds(), s.ambient.Load(), after)

	if r := s.retried.Load(); r > 0 {
		s.mu.Lock()
		first := s.firstRetry
		s.mu.Unlock()
		t.Logf("%d ADDs failed \"try again later\" and got a new sandbox, as kubelet gives one; the first: %v", r, first)
	}
	if f := s.failed.Load(); f > 0 {
		t.Errorf("%d of %d cycles failed, the first: %v", f, soakCycles+soakWarmup, s.firstErr())
	}
	if after.fds-after.netns > base.fds-base.netns+soakFDSlack {
		t.Errorf("descriptors: %d after the warm-up, %d after %d cycles", base.fds-base.netns, after.fds-after.netns, soakCycles)
	}
	if after.netns != 0 {
		t.Errorf("the agent holds %d network namespaces with no pod running", after.netns)
	}
	if after.goroutines > base.goroutines+soakGoroutineSlack {
		t.Errorf("goroutines: %d after the warm-up, %d after %d cycles", base.goroutines, after.goroutines, soakCycles)
	}
	if after.rss > base.rss+soakRSSSlack {
		t.Errorf("RSS: %.1f MiB after the warm-up, %.1f MiB after %d cycles", base.rss/(1<<20), after.rss/(1<<20), soakCycles)
	}
	if after.heap > base.heap+soakHeapSlack {
		t.Errorf("Go heap in use: %.1f MiB after the warm-up, %.1f MiB after %d cycles", base.heap/(1<<20), after.heap/(1<<20), soakCycles)
	}
	// Every per-pod table of the agent is back at its size after the
	// warm-up: the same pods exist, so nothing may have piled up. The
	// gauge is sampled every few seconds, and a torn-namespace mark of a
	// DEL that came after its pod's object was gone lasts its minute,
	// hence the wait.
	grown := func(tables map[string]float64) string {
		g := ""
		for table, v := range tables {
			if v > baseTables[table] {
				g += fmt.Sprintf(" %s %v -> %v", table, baseTables[table], v)
			}
		}
		return g
	}
	tables, _ := n.trackedPodsUntil(t, func(tables map[string]float64) bool { return grown(tables) == "" })
	if g := grown(tables); g != "" {
		t.Errorf("per-pod tables grew over %d cycles:%s", soakCycles, g)
	}
	t.Logf("per-pod tables after the warm-up %v, after the cycles %v", baseTables, tables)
	s.requireNothingLeft(ctx, t, amb, plain)
}

// trackedPodsSeries is one table's size in the agent's /metrics.
var trackedPodsSeries = regexp.MustCompile(`(?m)^ambient_cni_agent_tracked_pods\{table="([a-z_]+)"\} (\S+)$`)

// trackedPods reads the agent's per-pod table sizes from its /metrics.
func (n *node) trackedPods() (map[string]float64, error) {
	text, err := scrape.Text(n.metricsURL())
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, m := range trackedPodsSeries.FindAllStringSubmatch(text, -1) {
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m[0], err)
		}
		out[m[1]] = v
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no ambient_cni_agent_tracked_pods series in /metrics")
	}
	return out, nil
}

// trackedPodsUntil reads the agent's per-pod table sizes every second
// until done holds of them or three minutes passed (the gauge is sampled
// every few seconds, and a torn-namespace mark lasts its minute); it
// returns the last sizes read and whether done held.
func (n *node) trackedPodsUntil(t *testing.T, done func(map[string]float64) bool) (map[string]float64, bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		tables, err := n.trackedPods()
		if err != nil {
			t.Fatal(err)
		}
		if done(tables) {
			return tables, true
		}
		if time.Now().After(deadline) {
			return tables, false
		}
		time.Sleep(time.Second)
	}
}

// soaker runs ADD/DEL cycles.
type soaker struct {
	n       *node
	w       *world
	conf    *libcni.NetworkConfigList
	cni     *libcni.CNIConfig
	ambient atomic.Int64
	failed  atomic.Int64
	retried atomic.Int64
	mu      sync.Mutex
	errs    []error
	// firstRetry is the first ADD that got a new sandbox.
	firstRetry error
}

// soakAddTries is how many sandboxes a cycle's pod gets when its ADD is
// failed with "try again later" (kubelet retries without end).
const soakAddTries = 3

// isTryAgain reports whether err is the plugin's "try again later" (CNI
// error code 11): the runtime retries such an ADD with a new sandbox.
func isTryAgain(err error) bool {
	var e *cnitypes.Error
	return errors.As(err, &e) && e.Code == cnitypes.ErrTryAgainLater
}

func (s *soaker) firstErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.errs) == 0 {
		return nil
	}
	return s.errs[0]
}

// run runs total cycles over the workers' pods, each worker its share.
// A fixed share, not a shared counter: on a busy machine one worker may
// lag, and a warm-up that never reached some of its pods leaves their
// per-pod memory (a released sandbox) to appear only during the cycles,
// which the table check would take for growth.
func (s *soaker) run(ctx context.Context, t *testing.T, pods [soakWorkers][]*corev1.Pod, total int) {
	var done atomic.Int64
	var wg sync.WaitGroup
	for k := range soakWorkers {
		share := total / soakWorkers
		if k < total%soakWorkers {
			share++
		}
		if share < len(pods[k]) {
			t.Fatalf("soak: %d cycles leave some of worker %d's %d pods unvisited", total, k, len(pods[k]))
		}
		wg.Go(func() {
			for j := range share {
				if ctx.Err() != nil {
					return
				}
				i := done.Add(1)
				obj := pods[k][j%len(pods[k])]
				// Every 50th ambient cycle also checks the capture is
				// in place between ADD and DEL.
				err := s.cycle(ctx, obj, i%50 == 0)
				// An ADD the plugin fails with "try again later" (code
				// 11: on a busy machine ztunnel acked later than the
				// agent waits) is retried with a new sandbox, as kubelet
				// does; the retries are printed, and a pod that does not
				// start within soakAddTries sandboxes fails the soak.
				for try := 1; try < soakAddTries && isTryAgain(err); try++ {
					if s.retried.Add(1) == 1 {
						s.mu.Lock()
						s.firstRetry = err
						s.mu.Unlock()
					}
					err = s.cycle(ctx, obj, i%50 == 0)
				}
				if err != nil {
					s.failed.Add(1)
					s.mu.Lock()
					s.errs = append(s.errs, err)
					s.mu.Unlock()
				}
				if i%1000 == 0 {
					t.Logf("%d cycles", i)
				}
			}
		})
	}
	wg.Wait()
}

// requireTime stops the soak, saying so, when its time ran out during
// what (total cycles): a cycle cut then fails with its plugin killed
// ("signal: killed"), which is the run's budget, not the agent.
func (s *soaker) requireTime(ctx context.Context, t *testing.T, what string, total int) {
	t.Helper()
	if ctx.Err() != nil {
		t.Fatalf("the soak's time (go test's -timeout, less %v for cleanups; make's LONG_TIMEOUT) ran out during %s (%d cycles); %d cycles failed, the first: %v", cleanupMargin, what, total, s.failed.Load(), s.firstErr())
	}
}

// cycle is one sandbox: netns, ADD through the chain, DEL, netns gone.
func (s *soaker) cycle(ctx context.Context, obj *corev1.Pod, check bool) (rerr error) {
	netns, err := testutils.NewNS()
	if err != nil {
		return err
	}
	defer func() {
		// Not testutils.UnmountNS: it gives up on EBUSY (a plugin being
		// forked holds a copy of the descriptor) and leaks the mount.
		if err := testnet.RemoveNS(netns); err != nil && rerr == nil {
			rerr = err
		}
	}()
	if err := testnet.LoopbackUp(netns); err != nil {
		return err
	}
	rt := &libcni.RuntimeConf{
		ContainerID: testnet.RandName("", 64), NetNS: netns.Path(), IfName: "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", obj.Namespace}, {"K8S_POD_NAME", obj.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", ""}, {"K8S_POD_UID", string(obj.UID)},
		},
	}
	rt.Args[3][1] = rt.ContainerID
	captured := s.w.shouldCapture(obj)
	if _, err := s.cni.AddNetworkList(ctx, s.conf, rt); err != nil {
		_ = s.cni.DelNetworkList(ctx, s.conf, rt)
		return fmt.Errorf("ADD %s/%s: %w", obj.Namespace, obj.Name, err)
	}
	if captured {
		s.ambient.Add(1)
	}
	var checkErr error
	if check {
		rules, err := s.n.hasRules(netns.Path())
		switch {
		case err != nil:
			checkErr = err
		case rules != captured:
			checkErr = fmt.Errorf("%s/%s: after ADD, rules %v, want %v", obj.Namespace, obj.Name, rules, captured)
		}
	}
	if err := s.cni.DelNetworkList(ctx, s.conf, rt); err != nil {
		return fmt.Errorf("DEL %s/%s: %w", obj.Namespace, obj.Name, err)
	}
	return checkErr
}

// requireNothingLeft checks that no trace of the cycles is left anywhere.
func (s *soaker) requireNothingLeft(ctx context.Context, t *testing.T, namespaces ...string) {
	t.Helper()
	n := s.n
	if ips, err := n.rules.Probe.IPs(); err != nil || len(ips) > 0 {
		t.Errorf("probe set: %v (%v)", ips, err)
	}
	if ws := n.standIn().Workloads(); len(ws) > 0 {
		t.Errorf("the stand-in still serves %d workloads", len(ws))
	}
	// The gauge is sampled every few seconds: poll it.
	var out float64
	var err error
	if poll.Wait(ctx, 30*time.Second, func() bool {
		out, err = scrape.Sum(n.metricsURL(), "ambient_cni_enrolled_pods")
		return err == nil && out == 0
	}) != nil {
		t.Errorf("the agent's state holds %v pods (enrolled-pods metric; %v)", out, err)
	}
	if sp := n.spooled(); sp > 0 {
		t.Errorf("%d spooled DELs", sp)
	}
	for _, ns := range namespaces {
		list, err := n.env.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range list.Items {
			a := p.Annotations[ambient.RedirectionAnnotation]
			if a != "" && (a != ambient.RedirectionEnabled || !s.w.shouldCapture(&p)) {
				t.Errorf("pod %s/%s: annotation %q with no sandbox (captured: %v)", ns, p.Name, a, s.w.shouldCapture(&p))
			}
		}
	}
	if br, err := netlink.LinkByName(n.bridge); err != nil {
		t.Errorf("the node's bridge: %v", err)
	} else if links, err := netlink.LinkList(); err == nil {
		for _, l := range links {
			if l.Attrs().MasterIndex == br.Attrs().Index {
				t.Errorf("%s %s left on the bridge", l.Type(), l.Attrs().Name)
			}
		}
	}
	ipam, _ := filepath.Glob(filepath.Join(n.dir, "ipam", "*", "*"))
	for _, f := range ipam {
		if b := filepath.Base(f); b != "lock" && !strings.HasPrefix(b, "last_reserved_ip") {
			t.Errorf("host-local reservation left: %s", b)
		}
	}
}
