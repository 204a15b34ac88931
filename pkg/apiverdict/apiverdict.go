// Package apiverdict is the plugin's second tier, run only while the node
// agent cannot answer: it reads the plugin's own credential, asks the API
// server for the pod and its namespace (two GETs, plain net/http, no
// Kubernetes client), and decides with the agent's enablement policy.
// It lives in its own small binary (ambient-cni-fallback), which the
// plugin execs only then, so the plugin the runtime execs for every pod
// links no TLS or HTTP stack and starts no slower.
package apiverdict

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

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// MaxObjectBytes bounds one answer of the API server: a pod is at most a
// few hundred KiB (its annotations are capped at 256 KiB).
const MaxObjectBytes = 4 << 20

// Request names the pod the runtime is starting.
type Request struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// UID, when set, must be the pod's: another pod of the same name
	// (deleted and recreated) is not the one being started.
	UID string `json:"uid,omitempty"`
}

// Verdict is the answer, printed as JSON for the plugin.
type Verdict struct {
	// Enroll: the pod must be captured.
	Enroll bool `json:"enroll"`
	// Reason is the enablement reason.
	Reason string `json:"reason"`
}

// Decide asks the API server, with the credential cred, about the pod of
// req and decides with cred's policy. Any error means no verdict: the
// caller falls back to what it can vouch for without the API server.
func Decide(ctx context.Context, cred *plugincred.File, req Request) (Verdict, error) {
	policy, err := policyOf(cred.Policy)
	if err != nil {
		return Verdict{}, err
	}
	hc, err := httpClient(cred)
	if err != nil {
		return Verdict{}, err
	}
	base := strings.TrimSuffix(cred.Server, "/")
	var pod corev1.Pod
	if err := get(ctx, hc, cred.Token, base+"/api/v1/namespaces/"+url.PathEscape(req.Namespace)+"/pods/"+url.PathEscape(req.Name), "Pod", &pod); err != nil {
		return Verdict{}, err
	}
	if pod.Namespace != req.Namespace || pod.Name != req.Name {
		return Verdict{}, fmt.Errorf("API server answered pod %s/%s for %s/%s", pod.Namespace, pod.Name, req.Namespace, req.Name)
	}
	if req.UID != "" && string(pod.UID) != req.UID {
		return Verdict{}, fmt.Errorf("pod %s/%s has uid %s, the runtime starts %s", req.Namespace, req.Name, pod.UID, req.UID)
	}
	var ns corev1.Namespace
	if err := get(ctx, hc, cred.Token, base+"/api/v1/namespaces/"+url.PathEscape(req.Namespace), "Namespace", &ns); err != nil {
		return Verdict{}, err
	}
	if ns.Name != req.Namespace {
		return Verdict{}, fmt.Errorf("API server answered namespace %q for %q", ns.Name, req.Namespace)
	}
	d := policy.Decide(&pod, &ns)
	return Verdict{Enroll: d.Enroll, Reason: string(d.Reason)}, nil
}

func policyOf(p plugincred.Policy) (enablement.Policy, error) {
	out := enablement.Policy{ExcludedNamespaces: p.ExcludedNamespaces, DataPlaneNamespaces: p.DataPlaneNamespaces}
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

// get fetches one object of kind into out, bounded, and checks its kind.
func get(ctx context.Context, hc *http.Client, token, u, kind string, out any) error {
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
		return fmt.Errorf("get %s: HTTP %d", kind, resp.StatusCode)
	}
	return decodeObject(b, kind, out)
}

// decodeObject decodes one API object of kind (apiVersion v1) into out.
func decodeObject(b []byte, kind string, out any) error {
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(b, &tm); err != nil {
		return fmt.Errorf("decode %s: %w", kind, err)
	}
	if tm.Kind != kind || tm.APIVersion != "v1" {
		return fmt.Errorf("decode %s: got %s %s", kind, tm.APIVersion, tm.Kind)
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("decode %s: %w", kind, err)
	}
	return nil
}
