package deploy

import (
	"testing"
)

// The release's signal (the Service whose deletion the agents take for an
// uninstall) is one no controller writes to, so its watch carries no event
// until the uninstall: headless, no selector, no ports, no load balancer;
// kube-proxy skips it and istiod exports it nowhere. The agent is told its
// name, which is the release's.
func TestReleaseSignal(t *testing.T) {
	for _, c := range []struct {
		release, want string
	}{{releaseName, "ambient-cni-installed"}, {"mesh", "ambient-cni-mesh-installed"}} {
		o := decode(t, render(t, c.release, namespace))
		s := o.signal
		if s == nil || s.Name != c.want || s.Namespace != namespace {
			t.Fatalf("release %s: signal %+v, want Service %s/%s", c.release, s, namespace, c.want)
		}
		if s.Spec.ClusterIP != "None" || s.Spec.Selector != nil || len(s.Spec.Ports) != 0 || s.Spec.Type != "" {
			t.Errorf("release %s: signal spec %+v: want headless, no selector, no ports", c.release, s.Spec)
		}
		if s.Labels["service.kubernetes.io/service-proxy-name"] == "" || s.Annotations["networking.istio.io/exportTo"] != "~" {
			t.Errorf("release %s: signal labels %v annotations %v: want kube-proxy and istiod to skip it", c.release, s.Labels, s.Annotations)
		}
		if env := o.env(t); env["AMBIENT_RELEASE_SIGNAL"] != c.want {
			t.Errorf("release %s: agent told signal %q, want %q", c.release, env["AMBIENT_RELEASE_SIGNAL"], c.want)
		}
	}
}
