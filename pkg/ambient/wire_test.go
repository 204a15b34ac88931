package ambient

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
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

func TestDecodePodEvent(t *testing.T) {
	good := `{"command":"ADD","podName":"web","podNamespace":"shop","podUID":"u1","sandboxID":"sb1","netns":"/var/run/netns/x","ips":["10.0.0.1"]}`
	if ev, err := DecodePodEvent([]byte(good)); err != nil || ev.PodName != "web" {
		t.Fatalf("good event: %+v, %v", ev, err)
	}
	for name, in := range map[string]string{
		"empty":         ``,
		"null":          `null`,
		"unknown field": strings.Replace(good, `{`, `{"x":1,`, 1),
		"trailing":      good + ` 1`,
		"two objects":   good + good,
		"invalid":       strings.Replace(good, `"web"`, `"WEB"`, 1),
		"oversized":     `{"podName":"` + strings.Repeat("a", MaxRequestBytes) + `"}`,
		"dup command":   strings.Replace(good, `"ADD"`, `"ADD","command":"RM"`, 1),
	} {
		if _, err := DecodePodEvent([]byte(in)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestDecodeGCRequest(t *testing.T) {
	if r, err := DecodeGCRequest([]byte(`{"validSandboxIDs":["a","b"]}`)); err != nil || len(r.ValidSandboxIDs) != 2 {
		t.Fatalf("good request: %+v, %v", r, err)
	}
	many, _ := json.Marshal(GCRequest{ValidSandboxIDs: make([]string, maxGCIDs+1)})
	for name, in := range map[string]string{
		"missing list": `{}`,
		"null list":    `{"validSandboxIDs":null}`,
		"empty id":     `{"validSandboxIDs":[""]}`,
		"space in id":  `{"validSandboxIDs":["a b"]}`,
		"too many":     string(many),
	} {
		if _, err := DecodeGCRequest([]byte(in)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzPodEventDecode(f *testing.F) {
	fuzzseed.Add(f, "FuzzPodEventDecode")
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

func FuzzDecodePodEvent(f *testing.F) {
	fuzzseed.Add(f, "FuzzDecodePodEvent")
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := DecodePodEvent(b)
		if err != nil {
			return
		}
		if ev.Validate() != nil || len(ev.Addrs()) != len(ev.IPs) {
			t.Fatalf("accepted an invalid event %+v", ev)
		}
		if ev.Command != CommandDel && ev.Netns == "" {
			t.Fatalf("accepted %s without netns", ev.Command)
		}
	})
}

func FuzzDecodeGCRequest(f *testing.F) {
	fuzzseed.Add(f, "FuzzDecodeGCRequest")
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeGCRequest(b)
		if err != nil {
			return
		}
		if r.ValidSandboxIDs == nil || len(r.ValidSandboxIDs) > maxGCIDs {
			t.Fatalf("accepted %+v", r)
		}
		for _, id := range r.ValidSandboxIDs {
			if id == "" || strings.IndexFunc(id, func(c rune) bool { return c < 0x21 || c > 0x7e }) >= 0 {
				t.Fatalf("accepted id %q", id)
			}
		}
	})
}

func FuzzDecodePluginLog(f *testing.F) {
	fuzzseed.Add(f, "FuzzDecodePluginLog")
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := DecodePluginLog(b)
		if err != nil {
			return
		}
		if len(l.Records) == 0 || len(l.Records) > MaxPluginLogRecords {
			t.Fatalf("accepted %d records", len(l.Records))
		}
		for _, r := range l.Records {
			if len(r.Msg) > maxPluginLogText || len(r.Attrs)%2 != 0 || len(r.Attrs) > maxPluginLogAttrs {
				t.Fatalf("accepted an invalid record %+v", r)
			}
			for i := 0; i < len(r.Attrs); i += 2 {
				if r.Attrs[i] == "" || !printable(r.Attrs[i]) {
					t.Fatalf("accepted key %q", r.Attrs[i])
				}
			}
		}
	})
}

// A plugin log the agent takes: the records a plugin sends, within the
// limits; one past a limit is refused.
func TestDecodePluginLogLimits(t *testing.T) {
	rec := func(n int) string {
		return `{"level":"WARN","msg":"` + strings.Repeat("m", n) + `"}`
	}
	many := strings.Repeat(rec(1)+",", MaxPluginLogRecords)
	for body, ok := range map[string]bool{
		`{"records":[` + rec(maxPluginLogText) + `]}`:                      true,
		`{"records":[` + rec(maxPluginLogText+1) + `]}`:                    false,
		`{"records":[` + strings.TrimSuffix(many, ",") + `]}`:              true,
		`{"records":[` + many + rec(1) + `]}`:                              false,
		`{"records":[{"level":"WARN","msg":"x","attrs":["k","v"]}],"x":1}`: false,
		`{"records":[` + rec(1) + `]}{}`:                                   false,
	} {
		if _, err := DecodePluginLog([]byte(body)); (err == nil) != ok {
			t.Errorf("%.60s…: err %v, want ok=%v", body, err, ok)
		}
	}
}
