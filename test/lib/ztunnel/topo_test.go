package ztunnel

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// tpod is a network namespace on the test bridge, running an HTTP app on
// :8080 that answers with its name.
type tpod struct {
	name   string
	uid    string
	ns     ns.NetNS
	v4, v6 netip.Addr
}

// newBridge creates a hub namespace with a bridge and one pod namespace
// per name, each joined to it by a veth with IPv4 and IPv6 addresses.
func newBridge(t *testing.T, names ...string) map[string]*tpod {
	t.Helper()
	hub := testnet.NewNS(t)
	if err := hub.Do(func(ns.NetNS) error {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
		if err := netlink.LinkAdd(br); err != nil {
			return err
		}
		return netlink.LinkSetUp(br)
	}); err != nil {
		t.Fatalf("bridge: %v", err)
	}
	var r [2]byte
	_, _ = rand.Read(r[:])
	r[0] = 200 + r[0]%50
	pods := map[string]*tpod{}
	for i, name := range names {
		p := &tpod{
			name: name,
			uid:  fmt.Sprintf("uid-%s-%x", name, r),
			ns:   testnet.NewNS(t),
			v4:   netip.AddrFrom4([4]byte{10, r[0], r[1], byte(i + 1)}),
			v6:   netip.MustParseAddr(fmt.Sprintf("fd00:%x:%x::%x", r[0], r[1], i+1)),
		}
		podEnd, hubEnd := testnet.RandName("tzp", 8), testnet.RandName("tzh", 8)
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: podEnd}, PeerName: hubEnd}); err != nil {
			t.Fatalf("veth: %v", err)
		}
		move := func(name string, target ns.NetNS) {
			l, err := netlink.LinkByName(name)
			if err == nil {
				err = netlink.LinkSetNsFd(l, int(target.Fd()))
			}
			if err != nil {
				t.Fatalf("move %s: %v", name, err)
			}
		}
		move(podEnd, p.ns)
		move(hubEnd, hub)
		if err := hub.Do(func(ns.NetNS) error {
			l, err := netlink.LinkByName(hubEnd)
			if err != nil {
				return err
			}
			br, err := netlink.LinkByName("br0")
			if err != nil {
				return err
			}
			if err := netlink.LinkSetMaster(l, br); err != nil {
				return err
			}
			return netlink.LinkSetUp(l)
		}); err != nil {
			t.Fatalf("hub side: %v", err)
		}
		if err := p.ns.Do(func(ns.NetNS) error {
			l, err := netlink.LinkByName(podEnd)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetName(l, "eth0"); err != nil {
				return err
			}
			for _, a := range []netip.Addr{p.v4, p.v6} {
				bits := 24
				if a.Is6() {
					bits = 64
				}
				addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}}
				if a.Is6() {
					addr.Flags = unix.IFA_F_NODAD
				}
				if err := netlink.AddrAdd(l, addr); err != nil {
					return err
				}
			}
			return netlink.LinkSetUp(l)
		}); err != nil {
			t.Fatalf("pod side: %v", err)
		}
		testnet.WaitLinkReady(t, hub, hubEnd)
		testnet.WaitLinkReady(t, p.ns, "eth0")
		p.serveApp(t)
		pods[name] = p
	}
	return pods
}

// serveApp runs the pod's HTTP app on :8080 (both families).
func (p *tpod) serveApp(t *testing.T) {
	t.Helper()
	var ln net.Listener
	if err := p.ns.Do(func(ns.NetNS) error {
		var err error
		ln, err = net.Listen("tcp", ":8080")
		return err
	}); err != nil {
		t.Fatalf("app listener in %s: %v", p.name, err)
	}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = fmt.Fprintf(w, "hello from %s (peer %s)", p.name, r.RemoteAddr)
		}),
		ReadHeaderTimeout: 5 * time.Second,
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); wg.Wait() })
}

// serveEcho runs a TCP echo server on port inside the pod.
func (p *tpod) serveEcho(t *testing.T, port uint16) uint16 {
	t.Helper()
	testnet.ServeEcho(t, p.ns, int(port))
	return port
}

// dial opens a TCP connection from inside the pod.
func (p *tpod) dial(t *testing.T, target netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	if err := p.ns.Do(func(ns.NetNS) error {
		var err error
		c, err = net.DialTimeout("tcp", target.String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatalf("%s dial %s: %v", p.name, target, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// get makes one HTTP request from inside pod p (a fresh connection).
func (p *tpod) get(ctx context.Context, target netip.AddrPort) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return testnet.HTTPGet(ctx, p.ns, "http://"+target.String()+"/")
}

func (p *tpod) mustGet(t *testing.T, target netip.AddrPort, wantFrom string) {
	t.Helper()
	body, err := p.get(context.Background(), target)
	if err != nil {
		t.Fatalf("%s -> %s: %v", p.name, target, err)
	}
	if !strings.HasPrefix(body, "hello from "+wantFrom) {
		t.Fatalf("%s -> %s: body %q, want hello from %s", p.name, target, body, wantFrom)
	}
}

// capture applies the in-pod redirection with the project's applier.
func (p *tpod) capture(t *testing.T) {
	t.Helper()
	b, err := iptables.DetectBackend(os.Getenv("AMBIENT_IPTABLES_BACKEND"))
	if err != nil {
		testnet.Missing(t, fmt.Sprintf("no usable iptables backend: %v", err))
	}
	a := iptables.NewApplier(nil, b)
	if err := a.Apply(p.ns.Path(), ruleset.PodConfig{}); err != nil {
		t.Fatalf("apply rules in %s: %v", p.name, err)
	}
	t.Cleanup(func() { _ = a.Remove(p.ns.Path()) })
}

// agent is a minimal node agent for these tests: a zds.Server with an
// enrolled-pod state it builds its snapshots from.
type agent struct {
	srv *zds.Server
	mu  sync.Mutex
	wl  map[string]zds.Workload
}

func startAgent(t *testing.T, ackTimeout time.Duration) *agent {
	t.Helper()
	a, _ := startAgentAt(t, t.TempDir()+"/zds.sock", ackTimeout)
	return a
}

// startAgentAt runs an agent on path; stop shuts it down (also at the end
// of the test) and closes its netns handles.
func startAgentAt(t *testing.T, path string, ackTimeout time.Duration) (*agent, func()) {
	t.Helper()
	a := &agent{wl: map[string]zds.Workload{}}
	a.srv = zds.NewServer(zds.Config{
		SocketPath: path,
		Snapshot:   a.snapshot,
		AckTimeout: ackTimeout,
		AcceptRate: 1000, AcceptBurst: 100,
	})
	if err := a.srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.srv.Serve(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
			a.mu.Lock()
			defer a.mu.Unlock()
			for _, w := range a.wl {
				if w.Netns != nil {
					_ = w.Netns.Close()
				}
			}
		})
	}
	t.Cleanup(stop)
	return a, stop
}

func (a *agent) snapshot() []zds.Workload {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]zds.Workload, 0, len(a.wl))
	for _, w := range a.wl {
		out = append(out, w)
	}
	return out
}

// enroll records the pod, then hands it to ztunnel, as the real agent must.
func (a *agent) enroll(t *testing.T, p *tpod) {
	t.Helper()
	f, err := os.Open(p.ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	w := zds.Workload{UID: p.uid, Info: zds.WorkloadInfo{Name: p.name, Namespace: "test", ServiceAccount: "default"}, Netns: f}
	a.mu.Lock()
	if old, ok := a.wl[p.uid]; ok && old.Netns != nil {
		_ = old.Netns.Close()
	}
	a.wl[p.uid] = w
	a.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.srv.Add(ctx, w); err != nil {
		t.Fatalf("add %s: %v", p.name, err)
	}
}

// lose keeps a pod in the state but without its netns handle, so a
// snapshot names it with Keep.
func (a *agent) lose(p *tpod) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if w, ok := a.wl[p.uid]; ok && w.Netns != nil {
		_ = w.Netns.Close()
		w.Netns = nil
		a.wl[p.uid] = w
	}
}

// forget drops a pod from the state without telling ztunnel (an agent
// that lost it), or with a Del when del is set.
func (a *agent) forget(t *testing.T, p *tpod, del bool) {
	t.Helper()
	a.mu.Lock()
	if w, ok := a.wl[p.uid]; ok {
		if w.Netns != nil {
			_ = w.Netns.Close()
		}
		delete(a.wl, p.uid)
	}
	a.mu.Unlock()
	if del {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := a.srv.Del(ctx, p.uid); err != nil {
			t.Fatalf("del %s: %v", p.name, err)
		}
	}
}

func netnsOf(t *testing.T, p *tpod) NetnsID {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(p.ns.Path(), &st); err != nil {
		t.Fatal(err)
	}
	return NetnsID{Dev: st.Dev, Ino: st.Ino}
}
