package nodeagent

import (
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

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
