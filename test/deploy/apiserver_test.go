package deploy

import "testing"

// apiServer.host points install-cni's in-cluster client at an API server
// endpoint of the operator's choice instead of the kubernetes Service
// (which host-network pods reach only through a Service proxy). Unset, the
// chart leaves kubelet's Service variables alone.
func TestAPIServerOverride(t *testing.T) {
	env := decode(t, render(t, releaseName, namespace)).env(t)
	for _, k := range []string{"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"} {
		if v, ok := env[k]; ok {
			t.Errorf("defaults set %s=%q; the in-cluster default must stay", k, v)
		}
	}
	env = decode(t, render(t, "all", "all-values-ns", "-f", allValues)).env(t)
	if env["KUBERNETES_SERVICE_HOST"] != "api.mesh.example.com" || env["KUBERNETES_SERVICE_PORT"] != "6443" {
		t.Errorf("all values: KUBERNETES_SERVICE_HOST=%q KUBERNETES_SERVICE_PORT=%q", env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"])
	}
	env = decode(t, render(t, releaseName, namespace, "--set", "apiServer.host=127.0.0.1")).env(t)
	if env["KUBERNETES_SERVICE_HOST"] != "127.0.0.1" || env["KUBERNETES_SERVICE_PORT"] != "443" {
		t.Errorf("host only: KUBERNETES_SERVICE_HOST=%q KUBERNETES_SERVICE_PORT=%q (port defaults to 443)", env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"])
	}
	env = decode(t, render(t, releaseName, namespace, "--set", "apiServer.host=fd00::1", "--set", "apiServer.port=6443")).env(t)
	if env["KUBERNETES_SERVICE_HOST"] != "fd00::1" {
		t.Errorf("IPv6 host: KUBERNETES_SERVICE_HOST=%q", env["KUBERNETES_SERVICE_HOST"])
	}
}
