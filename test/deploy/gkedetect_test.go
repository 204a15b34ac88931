package deploy

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// With platform empty, a cluster whose version string says -gke gets the
// gke layout, as istio-cni detects GKE's bin dir. helm template
// --kube-version cannot show it (helm keeps only major.minor.patch of the
// flag), so the chart is rendered against the real API server, through a
// proxy that answers /version as a GKE control plane does (gitVersion
// v1.x.y-gke.N) and passes everything else through: helm template
// --validate takes the cluster's version from there, as helm install does.
func TestGKEDetectedFromClusterVersion(t *testing.T) {
	env := kube.Env(t)
	ns := env.CreateNamespace(t, "", nil).Name
	cases := map[string]struct {
		suffix string
		args   []string
		want   platformWant
	}{
		"-gke version":                {"-gke.1000", nil, platformWant{binDir: "/home/kubernetes/bin", confDir: "/etc/cni/net.d", netnsDirs: genericNetns, quota: true}},
		"plain version":               {"", nil, generic},
		"-gke version, platform wins": {"-gke.1000", []string{"--set", "platform=k3s"}, platformWant{binDir: "/var/lib/rancher/k3s/data/cni", confDir: "/var/lib/rancher/k3s/agent/etc/cni/net.d", netnsDirs: genericNetns}},
	}
	for name, c := range cases {
		kc := versionProxy(t, env, c.suffix)
		args := append([]string{"template", releaseName, chartDir, "--namespace", ns, "--no-hooks", "--validate", "--kubeconfig", kc}, c.args...)
		out, err := helm(t, args...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		o := decode(t, out)
		vols := map[string]string{}
		for _, v := range o.ds.Spec.Template.Spec.Volumes {
			if v.HostPath != nil {
				vols[v.Name] = v.HostPath.Path
			}
		}
		if vols["cni-bin-dir"] != c.want.binDir || vols["cni-conf-dir"] != c.want.confDir {
			t.Errorf("%s: host bin dir %s, conf dir %s; want %s, %s", name, vols["cni-bin-dir"], vols["cni-conf-dir"], c.want.binDir, c.want.confDir)
		}
		if got := o.rq != nil; got != c.want.quota {
			t.Errorf("%s: ResourceQuota rendered: %v, want %v", name, got, c.want.quota)
		}
	}
}

// versionProxy serves the API server on loopback with suffix appended to
// the gitVersion of /version, and returns a kubeconfig for it.
func versionProxy(t *testing.T, env *kubeenv.Env, suffix string) string {
	t.Helper()
	up, err := url.Parse(env.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := rest.TransportFor(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	p := httputil.NewSingleHostReverseProxy(up)
	p.Transport = tr
	p.ModifyResponse = func(r *http.Response) error {
		if r.Request.URL.Path != "/version" || r.StatusCode != http.StatusOK {
			return nil
		}
		b, err := io.ReadAll(r.Body)
		_ = r.Body.Close()
		if err != nil {
			return err
		}
		var v map[string]any
		if err := json.Unmarshal(b, &v); err != nil {
			return err
		}
		v["gitVersion"] = v["gitVersion"].(string) + suffix
		if b, err = json.Marshal(v); err != nil {
			return err
		}
		r.Body = io.NopCloser(bytes.NewReader(b))
		r.ContentLength = int64(len(b))
		r.Header.Set("Content-Length", strconv.Itoa(len(b)))
		return nil
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	kc := clientcmdapi.NewConfig()
	kc.Clusters["proxy"] = &clientcmdapi.Cluster{Server: srv.URL}
	kc.AuthInfos["proxy"] = &clientcmdapi.AuthInfo{}
	kc.Contexts["proxy"] = &clientcmdapi.Context{Cluster: "proxy", AuthInfo: "proxy"}
	kc.CurrentContext = "proxy"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
