package fallback

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

// apiServer serves pods and namespaces as the API server does, or a
// hostile answer for the paths in hostile.
type apiServer struct {
	pods    map[string]*corev1.Pod
	nss     map[string]*corev1.Namespace
	hostile map[string]func(w http.ResponseWriter)
	// objs are other objects by path (the agent's DaemonSet, the node).
	objs  map[string]any
	token string
	// asked are the paths asked, in order.
	mu    sync.Mutex
	asked []string
}

func (s *apiServer) paths() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.asked)
}

func (s *apiServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Authorization") != "Bearer "+s.token {
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	s.mu.Lock()
	s.asked = append(s.asked, r.URL.Path)
	s.mu.Unlock()
	if h := s.hostile[r.URL.Path]; h != nil {
		h(w)
		return
	}
	if o, ok := s.objs[r.URL.Path]; ok {
		_ = json.NewEncoder(w).Encode(o)
		return
	}
	parts := strings.Split(strings.TrimPrefix(r.URL.Path, "/api/v1/namespaces/"), "/")
	var obj any
	switch {
	case len(parts) == 1 && s.nss[parts[0]] != nil:
		obj = s.nss[parts[0]]
	case len(parts) == 3 && parts[1] == "pods" && s.pods[parts[0]+"/"+parts[2]] != nil:
		obj = s.pods[parts[0]+"/"+parts[2]]
	default:
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"apiVersion":"v1","kind":"Status","code":404}`))
		return
	}
	_ = json.NewEncoder(w).Encode(obj)
}

func pod(ns, name, uid string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("u-" + uidOr(uid, name)), Labels: labels}}
}

func uidOr(uid, name string) string {
	if uid != "" {
		return uid
	}
	return name
}

func namespace(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Namespace"}, ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

func newServer(t *testing.T) (*apiServer, *plugincred.File) {
	t.Helper()
	amb := map[string]string{"istio.io/dataplane-mode": "ambient"}
	s := &apiServer{token: "tok", hostile: map[string]func(http.ResponseWriter){}, objs: map[string]any{},
		pods: map[string]*corev1.Pod{
			"shop/web": pod("shop", "web", "", nil), "plain/labelled": pod("plain", "labelled", "", amb),
			"plain/app": pod("plain", "app", "", nil), "istio-system/ztunnel": pod("istio-system", "ztunnel", "", map[string]string{"app": "ztunnel"}),
			"shop/opted-out": pod("shop", "opted-out", "", map[string]string{"istio.io/dataplane-mode": "none"}),
		},
		nss: map[string]*corev1.Namespace{"shop": namespace("shop", amb), "plain": namespace("plain", nil), "istio-system": namespace("istio-system", nil)},
	}
	srv := httptest.NewTLSServer(s)
	t.Cleanup(srv.Close)
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	cred := &plugincred.File{Server: srv.URL, CA: string(caPEM), Token: "tok", NodeName: "n1",
		Policy: plugincred.Policy{ExcludedNamespaces: []string{"kube-system"}, DataPlaneNamespaces: []string{"istio-system"}}}
	if err := cred.Validate(); err != nil {
		t.Fatal(err)
	}
	return s, cred
}

func decide(t *testing.T, cred *plugincred.File, ns, name, uid string) (ambient.FallbackVerdict, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	return Decide(ctx, cred, ambient.FallbackRequest{Namespace: ns, Name: name, UID: uid})
}

func TestDecide(t *testing.T) {
	_, cred := newServer(t)
	for _, c := range []struct {
		ns, name string
		enroll   bool
	}{{"shop", "web", true}, {"plain", "labelled", true}, {"plain", "app", false}, {"istio-system", "ztunnel", false}, {"shop", "opted-out", false}} {
		v, err := decide(t, cred, c.ns, c.name, "u-"+c.name)
		if err != nil || v.Enroll != c.enroll || v.Reason == "" {
			t.Errorf("%s/%s: %+v, %v; want enroll %v", c.ns, c.name, v, err, c.enroll)
		}
	}
	// A custom selector list in the policy is honoured.
	cred.Policy.EnablementSelectors = `[{podSelector: {matchLabels: {app: ztunnel}}}]`
	if v, err := decide(t, cred, "plain", "labelled", ""); err != nil || v.Enroll {
		t.Errorf("custom selectors: %+v, %v", v, err)
	}
	cred.Policy.EnablementSelectors = `[{podSelector: {matchLabelz: {}}}]`
	if _, err := decide(t, cred, "plain", "app", ""); err == nil {
		t.Errorf("a policy whose selectors do not parse gave a verdict")
	}
}

// Whatever the API server (or something in its place) answers, only a
// well-formed answer about the very pod asked for is a verdict.
func TestDecideHostileAnswers(t *testing.T) {
	podPath := "/api/v1/namespaces/shop/pods/web"
	for name, h := range map[string]func(http.ResponseWriter){
		"forbidden":    func(w http.ResponseWriter) { w.WriteHeader(http.StatusForbidden) },
		"server error": func(w http.ResponseWriter) { w.WriteHeader(http.StatusInternalServerError) },
		"malformed":    func(w http.ResponseWriter) { _, _ = w.Write([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":`)) },
		"wrong kind": func(w http.ResponseWriter) {
			_, _ = w.Write([]byte(`{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"web"}}`))
		},
		"wrong version": func(w http.ResponseWriter) {
			_, _ = w.Write([]byte(`{"apiVersion":"v2","kind":"Pod","metadata":{"name":"web","namespace":"shop"}}`))
		},
		"another pod": func(w http.ResponseWriter) { _ = json.NewEncoder(w).Encode(pod("shop", "other", "", nil)) },
		"oversized": func(w http.ResponseWriter) {
			_, _ = w.Write([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web","namespace":"shop","annotations":{"a":"`))
			_, _ = w.Write([]byte(strings.Repeat("x", MaxObjectBytes)))
			_, _ = w.Write([]byte(`"}}}`))
		},
		"redirect": func(w http.ResponseWriter) {
			w.Header().Set("Location", "https://example.invalid/")
			w.WriteHeader(http.StatusFound)
		},
		"hangs": func(w http.ResponseWriter) { time.Sleep(5 * time.Second) },
	} {
		t.Run(name, func(t *testing.T) {
			s, cred := newServer(t)
			s.hostile[podPath] = h
			if v, err := decide(t, cred, "shop", "web", ""); err == nil {
				t.Errorf("verdict %+v from a %s answer", v, name)
			}
		})
	}
	s, cred := newServer(t)
	s.hostile["/api/v1/namespaces/shop"] = func(w http.ResponseWriter) {
		_, _ = w.Write([]byte(`{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"plain"}}`))
	}
	if v, err := decide(t, cred, "shop", "web", ""); err == nil {
		t.Errorf("verdict %+v with another namespace's labels", v)
	}
	// A recreated pod (another UID) is not the one being started.
	_, cred = newServer(t)
	if v, err := decide(t, cred, "shop", "web", "u-old"); err == nil {
		t.Errorf("verdict %+v for a pod of another UID", v)
	}
	// A token the server rejects gives no verdict.
	_, cred = newServer(t)
	cred.Token = "other"
	if _, err := decide(t, cred, "shop", "web", ""); err == nil {
		t.Errorf("verdict with a rejected token")
	}
}

const (
	dsPath   = "/apis/apps/v1/namespaces/istio-system/daemonsets/ambient-cni"
	nodePath = "/api/v1/nodes/n1"
)

func daemonSet(nodeSelector map[string]string) *appsv1.DaemonSet {
	ds := &appsv1.DaemonSet{TypeMeta: metav1.TypeMeta{APIVersion: "apps/v1", Kind: "DaemonSet"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "ambient-cni"}}
	ds.Spec.Template.Spec.NodeSelector = nodeSelector
	return ds
}

// Before a pod that must be captured waits, the fallback tells whether an
// agent can still come: the agent's DaemonSet exists and still runs on the
// node. Only then, only when asked, and never at the verdict's expense.
func TestDecideAgentGone(t *testing.T) {
	node := &corev1.Node{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
		ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"mesh": "on"}}}
	deleting := daemonSet(nil)
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	for _, c := range []struct {
		name  string
		setup func(s *apiServer)
		// want is a part of AgentGone, "" for none.
		want string
	}{
		{"still runs on the node", func(s *apiServer) { s.objs[dsPath] = daemonSet(map[string]string{"mesh": "on"}) }, ""},
		{"deleted", func(s *apiServer) {}, "istio-system/ambient-cni is deleted"},
		{"being deleted", func(s *apiServer) { s.objs[dsPath] = deleting }, "istio-system/ambient-cni is being deleted"},
		{"node not selected", func(s *apiServer) { s.objs[dsPath] = daemonSet(map[string]string{"mesh": "off"}) },
			"istio-system/ambient-cni no longer runs on node n1 (its nodeSelector does not match the node's labels)"},
		// An older chart: the plugin's role reads neither.
		{"DaemonSet forbidden", func(s *apiServer) {
			s.hostile[dsPath] = func(w http.ResponseWriter) { w.WriteHeader(http.StatusForbidden) }
		}, ""},
		{"node forbidden", func(s *apiServer) {
			s.objs[dsPath] = daemonSet(map[string]string{"mesh": "off"})
			s.hostile[nodePath] = func(w http.ResponseWriter) { w.WriteHeader(http.StatusForbidden) }
		}, ""},
		{"DaemonSet answer of another kind", func(s *apiServer) { s.objs[dsPath] = node }, ""},
		{"another DaemonSet", func(s *apiServer) {
			ds := daemonSet(map[string]string{"mesh": "off"})
			ds.Name = "ztunnel"
			s.objs[dsPath] = ds
		}, ""},
		{"DaemonSet hangs", func(s *apiServer) { s.hostile[dsPath] = func(http.ResponseWriter) { time.Sleep(5 * time.Second) } }, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, cred := newServer(t)
			cred.DaemonSet = &plugincred.ObjectRef{Namespace: "istio-system", Name: "ambient-cni"}
			s.objs[nodePath] = node
			c.setup(s)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			v, err := Decide(ctx, cred, ambient.FallbackRequest{Namespace: "shop", Name: "web", CheckAgent: true})
			if err != nil || !v.Enroll {
				t.Fatalf("%+v, %v: want the verdict whatever the DaemonSet check finds", v, err)
			}
			if (c.want == "") != (v.AgentGone == "") || !strings.Contains(v.AgentGone, c.want) {
				t.Errorf("AgentGone %q, want %q", v.AgentGone, c.want)
			}
		})
	}
	// Asked only for a pod that must be captured, only with CheckAgent,
	// only when the credential names the DaemonSet.
	for _, c := range []struct {
		name, pod string
		check     bool
		ref       *plugincred.ObjectRef
	}{
		{"pod outside the mesh", "app", true, &plugincred.ObjectRef{Namespace: "istio-system", Name: "ambient-cni"}},
		{"not asked to check", "labelled", false, &plugincred.ObjectRef{Namespace: "istio-system", Name: "ambient-cni"}},
		{"credential of an older agent", "labelled", true, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, cred := newServer(t)
			cred.DaemonSet = c.ref
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			v, err := Decide(ctx, cred, ambient.FallbackRequest{Namespace: "plain", Name: c.pod, CheckAgent: c.check})
			if err != nil || v.AgentGone != "" {
				t.Errorf("%+v, %v", v, err)
			}
			if got := s.paths(); len(got) != 2 {
				t.Errorf("asked %v, want only the pod and its namespace", got)
			}
		})
	}
}

func FuzzDecodeObject(f *testing.F) {
	fuzzseed.Add(f, "FuzzDecodeObject")
	f.Fuzz(func(t *testing.T, b []byte) {
		var p corev1.Pod
		if err := decodeObject(b, "v1", "Pod", &p); err != nil {
			return
		}
		var tm metav1.TypeMeta
		if err := json.Unmarshal(b, &tm); err != nil || tm.Kind != "Pod" || tm.APIVersion != "v1" {
			t.Fatalf("accepted %q as a v1 Pod", b)
		}
	})
}
