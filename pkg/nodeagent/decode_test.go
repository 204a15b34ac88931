package nodeagent

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

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
		"oversized":     `{"podName":"` + strings.Repeat("a", ambient.MaxRequestBytes) + `"}`,
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
	many, _ := json.Marshal(ambient.GCRequest{ValidSandboxIDs: make([]string, maxGCIDs+1)})
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

func TestPolicyDecider(t *testing.T) {
	d := NewPolicyDecider(enablement.DefaultPolicy())
	calls := 0
	d.OnChange(func() { calls++ })
	d.SetNamespace(namespace("shop", true))
	d.SetNamespace(namespace("kube-system", true))
	d.SetPod(pod("shop", "a", "u-a", nil))
	d.SetPod(pod("kube-system", "dns", "u-dns", nil))
	if dec, p, err := d.Decide(t.Context(), "shop", "a", "u-a"); err != nil || !dec.Enroll || p.UID != "u-a" {
		t.Errorf("shop/a: %+v %v", dec, err)
	}
	if dec, _, err := d.Decide(t.Context(), "kube-system", "dns", ""); err != nil || dec.Enroll || dec.Reason != enablement.ReasonExcludedNamespace {
		t.Errorf("kube-system/dns: %+v %v", dec, err)
	}
	if _, _, err := d.Decide(t.Context(), "shop", "a", "other"); err == nil {
		t.Errorf("uid mismatch accepted")
	}
	if _, _, err := d.Decide(t.Context(), "shop", "missing", ""); err == nil {
		t.Errorf("unknown pod accepted")
	}
	if en, pl := d.EnablementState(); strings.Join(en, ",") != "shop" || pl {
		t.Errorf("enablement %v %v (excluded namespaces are never enabled)", en, pl)
	}
	d.DeletePod("shop", "a")
	if calls != 5 {
		t.Errorf("OnChange called %d times, want 5", calls)
	}
}

func FuzzDecodePodEvent(f *testing.F) {
	addSeeds(f, "FuzzDecodePodEvent")
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := DecodePodEvent(b)
		if err != nil {
			return
		}
		if ev.Validate() != nil || len(ev.Addrs()) != len(ev.IPs) {
			t.Fatalf("accepted an invalid event %+v", ev)
		}
		if ev.Command != ambient.CommandDel && ev.Netns == "" {
			t.Fatalf("accepted %s without netns", ev.Command)
		}
	})
}

func FuzzDecodeGCRequest(f *testing.F) {
	addSeeds(f, "FuzzDecodeGCRequest")
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
