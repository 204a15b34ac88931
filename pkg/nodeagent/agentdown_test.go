package nodeagent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/poll"
	"github.com/ambient-cni/ambient-cni/test/testnet"
)

// TestServerNetnsCheckedOnlyForCapture: a netns path outside the allowed
// roots (a wrong netnsDirs setting) fails only pods that will be captured;
// pods that stay outside the mesh start, and their CHECK passes.
func TestServerNetnsCheckedOnlyForCapture(t *testing.T) {
	s := newServer(t, []string{t.TempDir()}, nil)
	pn := testnet.NewNS(t) // under the runtime's dir, not under the root
	s.kube.SetPod(pod("plain", "web", "u1", nil))
	s.kube.SetPod(pod("shop", "web", "u2", nil))
	out := addEvent(pn.Path())
	out.PodNamespace = "plain"
	if resp, err := s.send(t, out); err != nil || resp.Verdict != ambient.VerdictNotEnrolled {
		t.Errorf("ADD of a pod outside the mesh = %+v, %v; want not-enrolled", resp, err)
	}
	out.Command = ambient.CommandCheck
	if resp, err := s.send(t, out); err != nil || resp.Verdict != ambient.VerdictOK {
		t.Errorf("CHECK of a pod outside the mesh = %+v, %v", resp, err)
	}
	in := addEvent(pn.Path())
	in.PodUID = "u2"
	if resp, err := s.send(t, in); err != nil || resp.Error == "" || resp.Retryable || !strings.Contains(resp.Error, "not under an allowed root") {
		t.Errorf("ADD of a pod to capture = %+v, %v; want the netns refused", resp, err)
	}
}

// TestCaptureRefusesAnotherLivePodsNetns: an ADD naming the namespace a
// different enrolled pod holds, by its path or a symlink to it, is refused
// as invalid; once that pod is gone (no live holder) the namespace is no
// one's.
func TestCaptureRefusesAnotherLivePodsNetns(t *testing.T) {
	s := newServer(t, nil, nil)
	pn := testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "web", "u1", nil))
	s.kube.SetPod(pod("shop", "evil", "u2", nil))
	if resp, err := s.send(t, addEvent(pn.Path())); err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Fatalf("ADD = %+v, %v", resp, err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(pn.Path(), link); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{pn.Path(), link} {
		ev := &ambient.PodEvent{Command: ambient.CommandAdd, PodName: "evil", PodNamespace: "shop", PodUID: "u2", SandboxID: "sb2", Netns: path, IPs: []string{"10.9.0.6"}}
		resp, err := s.send(t, ev)
		if err != nil || resp.Error == "" || resp.Retryable || !strings.Contains(resp.Error, "live pod shop/web") {
			t.Errorf("ADD of another pod in %s = %+v, %v; want refused", path, resp, err)
		}
	}
	if got := s.zt.addCount("u2"); got != 0 {
		t.Errorf("ztunnel got the second pod %d times", got)
	}
	if resp, err := s.send(t, &ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "sb1", PodUID: "u1", PodName: "web", PodNamespace: "shop"}); err != nil || resp.Error != "" {
		t.Fatalf("DEL = %+v, %v", resp, err)
	}
	ev := &ambient.PodEvent{Command: ambient.CommandAdd, PodName: "evil", PodNamespace: "shop", PodUID: "u2", SandboxID: "sb2", Netns: pn.Path(), IPs: []string{"10.9.0.6"}}
	if resp, err := s.send(t, ev); err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Errorf("ADD once no live pod holds the netns = %+v, %v", resp, err)
	}
}

// TestRecheckPassedThrough: a serving agent refreshes its heartbeat, and
// re-checks the pods the plugin let through while it was gone: it captures
// those that should be, and forgets those decided out or gone.
func TestRecheckPassedThrough(t *testing.T) {
	s := newServer(t, nil, nil)
	hb := nodefiles.HeartbeatPath(s.sock)
	poll.Until(t, "heartbeat written", func() bool { _, err := nodefiles.LastAlive(hb); return err == nil })

	in, out := testnet.NewNS(t), testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "late", "u1", nil))
	s.kube.SetPod(pod("plain", "web", "u2", nil))
	dir := nodefiles.AddSpoolDir(s.sock)
	for _, ev := range []ambient.PodEvent{
		{Command: ambient.CommandAdd, PodName: "late", PodNamespace: "shop", PodUID: "u1", SandboxID: "sb1", Netns: in.Path(), IPs: []string{"10.9.0.5"}},
		{Command: ambient.CommandAdd, PodName: "web", PodNamespace: "plain", PodUID: "u2", SandboxID: "sb2", Netns: out.Path(), IPs: []string{"10.9.0.6"}},
		{Command: ambient.CommandAdd, PodName: "gone", PodNamespace: "shop", PodUID: "u3", SandboxID: "sb3", Netns: "/var/run/netns/none-such", IPs: []string{"10.9.0.7"}},
	} {
		if err := nodefiles.Spool(dir, ev); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.srv.RecheckPassedThrough(t.Context()); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "ADD spool drained", func() bool { e, _ := nodefiles.ListAdds(dir); return len(e) == 0 })
	pods := s.agent.Pods()
	if len(pods) != 1 || pods[0].UID != "u1" || pods[0].SandboxID != "sb1" {
		t.Errorf("enrolled after re-check: %+v; want only shop/late", pods)
	}
}
