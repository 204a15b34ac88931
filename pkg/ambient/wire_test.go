package ambient

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func validEvent() PodEvent {
	return PodEvent{Command: CommandAdd, PodName: "web-1", PodNamespace: "shop", PodUID: "0b7c6f0e-1111-2222-3333-444455556666",
		SandboxID: "abc123", Netns: "/var/run/netns/cni-1234", IfName: "eth0", IPs: []string{"10.1.0.5", "fd00::5"}}
}

func TestPodEventValidate(t *testing.T) {
	ok := validEvent()
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid event rejected: %v", err)
	}
	del := PodEvent{Command: CommandDel, SandboxID: "abc"}
	if err := del.Validate(); err != nil {
		t.Fatalf("DEL with only a sandbox id rejected: %v", err)
	}
	bad := map[string]func(*PodEvent){
		"unknown command":   func(e *PodEvent) { e.Command = "RM" },
		"empty name on ADD": func(e *PodEvent) { e.PodName = "" },
		"name with slash":   func(e *PodEvent) { e.PodName = "../etc" },
		"upper-case ns":     func(e *PodEvent) { e.PodNamespace = "Shop" },
		"long name":         func(e *PodEvent) { e.PodName = strings.Repeat("a", 300) },
		"uid with newline":  func(e *PodEvent) { e.PodUID = "a\nb" },
		"no sandbox":        func(e *PodEvent) { e.SandboxID = "" },
		"netns with nul":    func(e *PodEvent) { e.Netns = "/var/run/netns/a\x00b" },
		"no netns on ADD":   func(e *PodEvent) { e.Netns = "" },
		"long ifname":       func(e *PodEvent) { e.IfName = "eth0123456789012345" },
		"bad ip":            func(e *PodEvent) { e.IPs = []string{"10.0.0.300"} },
		"ip with zone":      func(e *PodEvent) { e.IPs = []string{"fe80::1%eth0"} },
		"not an ip":         func(e *PodEvent) { e.IPs = []string{"not-an-ip"} },
		"too many ips":      func(e *PodEvent) { e.IPs = make([]string, 17) },
	}
	for name, mut := range bad {
		e := validEvent()
		mut(&e)
		if err := e.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestSnapshotRule(t *testing.T) {
	var missing *EnablementSnapshot
	if !missing.MayNeedCapture("shop") {
		t.Error("missing snapshot must fail closed")
	}
	s := &EnablementSnapshot{Generation: 1, EnabledNamespaces: []string{"shop"}, ExcludedNamespaces: []string{"kube-system"}}
	if !s.MayNeedCapture("shop") || s.MayNeedCapture("other") || s.MayNeedCapture("kube-system") {
		t.Errorf("namespace rule wrong: %+v", s)
	}
	s.PodLevelEnablement = true
	if !s.MayNeedCapture("other") || s.MayNeedCapture("kube-system") {
		t.Errorf("pod-level rule wrong: %+v", s)
	}
}

func TestParseSnapshot(t *testing.T) {
	good, _ := json.Marshal(EnablementSnapshot{Generation: 3, EnabledNamespaces: []string{"a"}})
	if s, err := ParseSnapshot(good); err != nil || s.Generation != 3 {
		t.Fatalf("ParseSnapshot(good) = %v, %v", s, err)
	}
	for name, in := range map[string][]byte{
		"empty":          nil,
		"garbage":        []byte("{{{"),
		"zero gen":       []byte(`{"generation":0}`),
		"wrong type":     []byte(`{"generation":"1"}`),
		"huge":           make([]byte, maxSnapshotBytes+1),
		"negative gen":   []byte(`{"generation":-4}`),
		"array not obj":  []byte(`[1,2]`),
		"trailing bytes": []byte(`{"generation":1} x`),
	} {
		if _, err := ParseSnapshot(in); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzParseSnapshot(f *testing.F) {
	addSeeds(f, "FuzzParseSnapshot")
	f.Add([]byte(`{"generation":1,"enabledNamespaces":["a"],"podLevelEnablement":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseSnapshot(b)
		if err == nil && s.Generation <= 0 {
			t.Fatalf("accepted generation %d", s.Generation)
		}
	})
}

func FuzzPodEventDecode(f *testing.F) {
	addSeeds(f, "FuzzPodEventDecode")
	good, _ := json.Marshal(validEvent())
	f.Add(good)
	f.Fuzz(func(t *testing.T, b []byte) {
		var e PodEvent
		if json.Unmarshal(b, &e) != nil {
			return
		}
		if e.Validate() == nil {
			for _, a := range e.Addrs() {
				if !a.IsValid() {
					t.Fatalf("validated event has invalid addr %v", a)
				}
			}
			if len(e.Addrs()) != len(e.IPs) {
				t.Fatalf("validated event lost ips")
			}
		}
	})
}

// addSeeds adds every file in testdata/seeds/<name> as a seed; go test
// also replays testdata/fuzz/<name> on its own.
func addSeeds(f *testing.F, name string) {
	files, _ := filepath.Glob(filepath.Join("testdata", "seeds", name, "*"))
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
}
