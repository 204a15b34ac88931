// Package fallback is the plugin's second tier, run only while the node
// agent cannot answer: it reads the plugin's own credential, asks the API
// server for the pod and its namespace (two GETs, plain net/http, no
// Kubernetes client), and decides with the agent's enablement policy.
// For a pod that must be captured, and so will wait for the agent, it
// also tells whether an agent can still come: the agent's DaemonSet
// exists and still runs on this node (two more GETs).
// It lives in its own small binary (ambient-cni-fallback), which the
// plugin execs only then, so the plugin the runtime execs for every pod
// links no TLS or HTTP stack and starts no slower.
package fallback

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/dsplacement"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// MaxObjectBytes bounds one answer of the API server: a pod is at most a
// few hundred KiB (its annotations are capped at 256 KiB).
const MaxObjectBytes = 4 << 20

// Decide asks the API server, with the credential cred, about the pod of
// req and decides with cred's policy. Any error means no verdict: the
// caller falls back to what it can vouch for without the API server.
func Decide(ctx context.Context, cred *plugincred.File, req ambient.FallbackRequest) (ambient.FallbackVerdict, error) {
	policy, err := Policy(cred.Policy)
	if err != nil {
		return ambient.FallbackVerdict{}, err
	}
	hc, err := httpClient(cred)
	if err != nil {
		return ambient.FallbackVerdict{}, err
	}
	base := strings.TrimSuffix(cred.Server, "/")
	var pod corev1.Pod
	if err := get(ctx, hc, cred.Token, base+"/api/v1/namespaces/"+url.PathEscape(req.Namespace)+"/pods/"+url.PathEscape(req.Name), "v1", "Pod", &pod); err != nil {
		return ambient.FallbackVerdict{}, err
	}
	if pod.Namespace != req.Namespace || pod.Name != req.Name {
		return ambient.FallbackVerdict{}, fmt.Errorf("API server answered pod %s/%s for %s/%s", pod.Namespace, pod.Name, req.Namespace, req.Name)
	}
	if req.UID != "" && string(pod.UID) != req.UID {
		return ambient.FallbackVerdict{}, fmt.Errorf("pod %s/%s has uid %s, the runtime starts %s", req.Namespace, req.Name, pod.UID, req.UID)
	}
	var ns corev1.Namespace
	if err := get(ctx, hc, cred.Token, base+"/api/v1/namespaces/"+url.PathEscape(req.Namespace), "v1", "Namespace", &ns); err != nil {
		return ambient.FallbackVerdict{}, err
	}
	if ns.Name != req.Namespace {
		return ambient.FallbackVerdict{}, fmt.Errorf("API server answered namespace %q for %q", ns.Name, req.Namespace)
	}
	d := policy.Decide(&pod, &ns)
	v := ambient.FallbackVerdict{Enroll: d.Enroll, Reason: string(d.Reason)}
	if v.Enroll && req.CheckAgent {
		// Best effort: the verdict stands whatever this finds, and an
		// error (no RBAC for it under an older chart, a timeout) only
		// leaves the wait unexplained, as before.
		v.AgentGone, _ = agentGone(ctx, hc, cred, base)
	}
	return v, nil
}

// agentGone says why the agent's DaemonSet will never run an agent on the
// credential's node again, or "" when it still does; two more GETs, the
// DaemonSet and the Node, judged by the DaemonSet controller's predicate
// (dsplacement). An error means it cannot tell: the caller says nothing.
func agentGone(ctx context.Context, hc *http.Client, cred *plugincred.File, base string) (string, error) {
	ref := cred.DaemonSet
	if ref == nil || cred.NodeName == "" {
		return "", errors.New("plugin credential names no DaemonSet")
	}
	name := ref.Namespace + "/" + ref.Name
	var ds appsv1.DaemonSet
	err := get(ctx, hc, cred.Token, base+"/apis/apps/v1/namespaces/"+url.PathEscape(ref.Namespace)+"/daemonsets/"+url.PathEscape(ref.Name), "apps/v1", "DaemonSet", &ds)
	var se *statusError
	switch {
	case errors.As(err, &se) && se.code == http.StatusNotFound:
		// A 404 comes only past authorization: the DaemonSet is gone.
		return fmt.Sprintf("the agent's DaemonSet %s is deleted", name), nil
	case err != nil:
		return "", err
	case ds.Namespace != ref.Namespace || ds.Name != ref.Name:
		return "", fmt.Errorf("API server answered DaemonSet %s/%s for %s", ds.Namespace, ds.Name, name)
	case ds.DeletionTimestamp != nil:
		return fmt.Sprintf("the agent's DaemonSet %s is being deleted", name), nil
	}
	var node corev1.Node
	if err := get(ctx, hc, cred.Token, base+"/api/v1/nodes/"+url.PathEscape(cred.NodeName), "v1", "Node", &node); err != nil {
		return "", err
	}
	if node.Name != cred.NodeName {
		return "", fmt.Errorf("API server answered node %q for %q", node.Name, cred.NodeName)
	}
	targets, why, err := dsplacement.TargetsNode(&ds, &node)
	if err != nil || targets {
		return "", err
	}
	return fmt.Sprintf("the agent's DaemonSet %s no longer runs on node %s (%s)", name, cred.NodeName, why), nil
}

// Policy is the agent's enablement policy as the plugin's credential
// carries it, ready to decide with: the fallback binary decides by it with
// the agent's own function (enablement.Policy.Decide).
func Policy(p plugincred.Policy) (enablement.Policy, error) {
	out := enablement.Policy{ExcludedNamespaces: p.ExcludedNamespaces, DataPlaneNamespaces: p.DataPlaneNamespaces}
	if p.Self != nil {
		out.Self = types.NamespacedName{Namespace: p.Self.Namespace, Name: p.Self.Name}
	}
	if p.EnablementSelectors != "" {
		s, err := enablement.ParseSelectors([]byte(p.EnablementSelectors))
		if err != nil {
			return out, fmt.Errorf("plugin credential's policy: %w", err)
		}
		out.Selectors = s
	}
	return out, nil
}

func httpClient(cred *plugincred.File) (*http.Client, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(cred.CA)) {
		return nil, errors.New("plugin credential: no usable certificate in ca")
	}
	return &http.Client{
		Transport: &http.Transport{
			TLSClientConfig:       &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
			Proxy:                 nil, // a node's proxy settings are not the cluster's
			TLSHandshakeTimeout:   3 * time.Second,
			ResponseHeaderTimeout: 3 * time.Second,
			DisableCompression:    true,
		},
		// The API server does not redirect a GET of an object; a redirect
		// would carry the token elsewhere.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}, nil
}

// statusError is an answer of the API server other than 200.
type statusError struct {
	kind string
	code int
}

func (e *statusError) Error() string { return fmt.Sprintf("get %s: HTTP %d", e.kind, e.code) }

// get fetches one object of apiVersion and kind into out, bounded, and
// checks its type.
func get(ctx context.Context, hc *http.Client, token, u, apiVersion, kind string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "ambient-cni-fallback")
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("get %s: %w", kind, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxObjectBytes+1))
	if err != nil {
		return fmt.Errorf("get %s: read: %w", kind, err)
	}
	if len(b) > MaxObjectBytes {
		return fmt.Errorf("get %s: answer larger than %d bytes", kind, MaxObjectBytes)
	}
	if resp.StatusCode != http.StatusOK {
		return &statusError{kind: kind, code: resp.StatusCode}
	}
	return decodeObject(b, apiVersion, kind, out)
}

// decodeObject decodes one API object of apiVersion and kind into out.
func decodeObject(b []byte, apiVersion, kind string, out any) error {
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(b, &tm); err != nil {
		return fmt.Errorf("decode %s: %w", kind, err)
	}
	if tm.Kind != kind || tm.APIVersion != apiVersion {
		return fmt.Errorf("decode %s: got %s %s", kind, tm.APIVersion, tm.Kind)
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("decode %s: %w", kind, err)
	}
	return nil
}
