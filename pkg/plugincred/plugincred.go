// Package plugincred is the plugin's own API credential on the node: the
// file the agent writes into its state directory (the API server's URL
// and CA, a short-lived token of the plugin's ServiceAccount, and the
// enablement policy to decide by) and the rotator that keeps it fresh.
// The plugin's fallback reads it only while the agent cannot answer. It is
// pure: the agent hands the rotator a TokenSource, so no Kubernetes client
// is linked here.
package plugincred

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// MaxBytes bounds the file the fallback reads: a CA bundle, a token and a
// policy are a few KiB.
const MaxBytes = 256 << 10

// File is the credential file's content.
type File struct {
	// Server is the API server's https URL, as the agent reaches it.
	Server string `json:"server"`
	// CA is the PEM bundle the API server's certificate is checked against.
	CA string `json:"ca"`
	// Token is a bound ServiceAccount token of the plugin's own identity.
	Token string `json:"token"`
	// NodeName is the node the token is bound to.
	NodeName string `json:"nodeName"`
	// Policy is the agent's enablement policy, so the fallback decides as
	// the agent would.
	Policy Policy `json:"policy"`
	// DaemonSet is the agent's own DaemonSet: before the plugin makes a
	// pod wait for an agent, the fallback checks that one can still come
	// (the DaemonSet exists and still runs on NodeName). Absent (a file of
	// an older agent): no such check.
	DaemonSet *ObjectRef `json:"daemonSet,omitempty"`
}

// ObjectRef names a namespaced object.
type ObjectRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

// Policy is the enablement policy as the agent was configured.
type Policy struct {
	// ExcludedNamespaces are never captured.
	ExcludedNamespaces []string `json:"excludedNamespaces"`
	// DataPlaneNamespaces are where the data-plane labels exempt a pod.
	DataPlaneNamespaces []string `json:"dataPlaneNamespaces"`
	// EnablementSelectors is the agent's enablement-selector setting (YAML
	// or JSON); empty is Istio's default list.
	EnablementSelectors string `json:"enablementSelectors,omitempty"`
	// Self is the agent's own pod, never captured. Absent (a file of an
	// older agent): no pod is exempt by name.
	Self *ObjectRef `json:"self,omitempty"`
}

// Parse decodes and checks a credential file's contents.
func Parse(b []byte) (*File, error) {
	if len(b) == 0 {
		return nil, errors.New("plugin credential: empty")
	}
	if len(b) > MaxBytes {
		return nil, fmt.Errorf("plugin credential: %d bytes, more than %d", len(b), MaxBytes)
	}
	var f File
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("plugin credential: decode: %w", err)
	}
	if dec.More() {
		return nil, errors.New("plugin credential: trailing data after the object")
	}
	if err := f.Validate(); err != nil {
		return nil, err
	}
	return &f, nil
}

// Validate checks what the fallback relies on: an https server URL with a
// host, a CA, a token that fits in one header line.
func (f *File) Validate() error {
	u, err := url.Parse(f.Server)
	if err != nil || u.Scheme != "https" || u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("plugin credential: server %q is not an https URL of a host", f.Server)
	}
	if !strings.Contains(f.CA, "-----BEGIN CERTIFICATE-----") {
		return errors.New("plugin credential: no PEM certificate in ca")
	}
	if f.Token == "" || strings.ContainsFunc(f.Token, func(r rune) bool { return r <= ' ' || r > '~' }) {
		return errors.New("plugin credential: token empty or not printable ASCII")
	}
	for _, ns := range append(append([]string{}, f.Policy.ExcludedNamespaces...), f.Policy.DataPlaneNamespaces...) {
		if ns == "" || len(ns) > 63 {
			return fmt.Errorf("plugin credential: namespace %q in the policy is not a namespace name", ns)
		}
	}
	if ds := f.DaemonSet; ds != nil {
		// They become URL path segments and name the node: keep them to
		// what an object name can be.
		if !objectName(ds.Namespace, 63) || !objectName(ds.Name, 253) || !objectName(f.NodeName, 253) {
			return fmt.Errorf("plugin credential: daemonSet %q/%q on node %q is not a valid object reference", ds.Namespace, ds.Name, f.NodeName)
		}
	}
	return nil
}

// objectName: a non-empty name of lowercase letters, digits, '-' and '.',
// at most max bytes (the API server's own rules are stricter; this keeps
// anything that could change a request's path out).
func objectName(s string, max int) bool {
	return s != "" && len(s) <= max && s != "." && s != ".." &&
		!strings.ContainsFunc(s, func(r rune) bool { return (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '-' && r != '.' })
}

// Read reads and checks the credential at path. It must be a regular file
// that only root can read or write: anything else is not ours.
func Read(path string) (*File, error) {
	// O_NONBLOCK: a FIFO in its place fails the regular-file check instead
	// of blocking the open.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("plugin credential: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("plugin credential %s: not a regular file", path)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("plugin credential %s: mode %v, want no access for group and others", path, st.Mode().Perm())
	}
	if o := atomicfile.OwnerOf(st); o != nil && o.UID != os.Geteuid() {
		return nil, fmt.Errorf("plugin credential %s: owned by uid %d, not by us", path, o.UID)
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("plugin credential %s: %w", path, err)
	}
	return Parse(b)
}

// Write replaces the credential at path atomically, mode 0600, in a
// directory made 0700.
func Write(path string, f *File) error {
	if err := f.Validate(); err != nil {
		return err
	}
	b, err := json.Marshal(f)
	if err != nil {
		return fmt.Errorf("plugin credential: encode: %w", err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("plugin credential: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("plugin credential: %w", err)
	}
	if err := atomicfile.WriteFile(path, b, atomicfile.Options{Mode: 0o600}); err != nil {
		return fmt.Errorf("plugin credential: %w", err)
	}
	return nil
}

// Token is an issued token and when it expires.
type Token struct {
	// Value is the bearer token.
	Value string
	// Expires is when the API server said it expires; zero when it did
	// not say (the rotator then assumes the lifetime it asked for).
	Expires time.Time
}

// TokenSource issues a token of the plugin's identity valid for about
// lifetime (the API server may shorten it, and says so in Expires).
type TokenSource interface {
	Token(ctx context.Context, lifetime time.Duration) (Token, error)
}

// DefaultRenewAfter is the longest a token goes unrenewed: a long-lived
// token is still renewed daily, so after any renewal it outlasts an
// outage of its whole lifetime but a day.
const DefaultRenewAfter = 24 * time.Hour

// Rotator writes the credential and renews its token well before expiry.
// Its waits are Go timers, which run on the monotonic clock: a wall-clock
// change neither delays nor hastens a renewal.
type Rotator struct {
	// Path is the credential file.
	Path string
	// Base is the file's content but the token.
	Base File
	// Source issues the tokens.
	Source TokenSource
	// Lifetime is the token lifetime asked for.
	Lifetime time.Duration
	// RenewAfter caps the wait before a renewal: a token is renewed after
	// half the lifetime the API server granted or RenewAfter, whichever
	// comes first (zero: DefaultRenewAfter).
	RenewAfter time.Duration
	// Retry is the wait after a failed renewal (default 10 s).
	Retry time.Duration
	// Logger receives renewals and failures.
	Logger *slog.Logger
	// OnCredential, when set, is told when the token in place was issued
	// and when it expires, each time that changes (metrics).
	OnCredential func(issued, expires time.Time)
	// OnFailure, when set, is told of every failed attempt to obtain a
	// token (metrics).
	OnFailure func(error)

	mu sync.Mutex
	// issued and expires describe the token in place; zero: none.
	issued, expires time.Time
	// fresh: the last WriteOnce succeeded, so Run waits before the next;
	// else it retries soon.
	fresh bool
}

// InPlace returns when the token in place was issued and expires; ok is
// false while there is none.
func (r *Rotator) InPlace() (issued, expires time.Time, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.issued, r.expires, !r.expires.IsZero()
}

// inPlace records the token in place.
func (r *Rotator) inPlace(issued, expires time.Time, fresh bool) {
	r.mu.Lock()
	r.issued, r.expires, r.fresh = issued, expires, fresh
	r.mu.Unlock()
	if r.OnCredential != nil {
		r.OnCredential(issued, expires)
	}
}

// WriteOnce issues a token and writes the file.
func (r *Rotator) WriteOnce(ctx context.Context) error {
	r.mu.Lock()
	r.fresh = false
	r.mu.Unlock()
	err := r.writeOnce(ctx)
	if err != nil && r.OnFailure != nil {
		r.OnFailure(err)
	}
	return err
}

func (r *Rotator) writeOnce(ctx context.Context) error {
	issued := time.Now()
	tok, err := r.Source.Token(ctx, r.Lifetime)
	if err != nil {
		return fmt.Errorf("plugin credential: token: %w", err)
	}
	f := r.Base
	f.Token = tok.Value
	if err := Write(r.Path, &f); err != nil {
		return err
	}
	exp := tok.Expires
	if exp.IsZero() {
		exp = issued.Add(r.Lifetime)
	}
	r.inPlace(issued, exp, true)
	return nil
}

// KeepValid adopts the credential a previous agent left at Path when no
// new token can be had: if it is for the same API server and node and
// its token (a JWT, read for its iat and exp claims only) is still valid,
// it is rewritten with Base (this agent's policy) around the same token
// and counts as in place. It returns when that token expires.
func (r *Rotator) KeepValid() (time.Time, error) {
	old, err := Read(r.Path)
	if err != nil {
		return time.Time{}, err
	}
	if old.Server != r.Base.Server || old.NodeName != r.Base.NodeName {
		return time.Time{}, fmt.Errorf("plugin credential on disk is for %s on node %q, not %s on %q", old.Server, old.NodeName, r.Base.Server, r.Base.NodeName)
	}
	issued, exp, err := Claims(old.Token)
	if err != nil {
		return time.Time{}, err
	}
	if !time.Now().Before(exp) {
		return exp, fmt.Errorf("plugin credential on disk expired at %s", exp.UTC().Format(time.RFC3339))
	}
	f := r.Base
	f.Token = old.Token
	if err := Write(r.Path, &f); err != nil {
		return exp, err
	}
	r.inPlace(issued, exp, false)
	return exp, nil
}

// Claims reads a JWT's iat and exp claims, unverified: the agent only
// learns when a token it holds expires. A token without exp is refused.
func Claims(token string) (issued, expires time.Time, err error) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return time.Time{}, time.Time{}, errors.New("plugin credential: token is not a JWT")
	}
	b, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("plugin credential: token claims: %w", err)
	}
	var c struct {
		IssuedAt  int64 `json:"iat"`
		ExpiresAt int64 `json:"exp"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("plugin credential: token claims: %w", err)
	}
	if c.ExpiresAt <= 0 {
		return time.Time{}, time.Time{}, errors.New("plugin credential: token has no expiry")
	}
	if c.IssuedAt > 0 {
		issued = time.Unix(c.IssuedAt, 0)
	}
	return issued, time.Unix(c.ExpiresAt, 0), nil
}

// renewIn is how long after its issue the token in place is renewed:
// half the lifetime granted, at most RenewAfter.
func (r *Rotator) renewIn() time.Duration {
	after := r.RenewAfter
	if after <= 0 {
		after = DefaultRenewAfter
	}
	issued, exp, _ := r.InPlace()
	if half := exp.Sub(issued) / 2; half < after {
		after = half
	}
	return after
}

// Run renews the token until ctx ends: after half the lifetime granted
// (at most RenewAfter, less up to a tenth), retrying a failure after
// Retry, spread by ±50 %. The spread is for the fleet: agents that start
// together (a cluster's first install, a node pool created at once) would
// otherwise ask the API server for their tokens in the same instant at
// every retry and every renewal, and its fairness limits turn most of
// such a burst away. A token that could not be renewed in time expires,
// and the plugin then decides by its snapshot.
func (r *Rotator) Run(ctx context.Context) error {
	retry := r.Retry
	if retry <= 0 {
		retry = 10 * time.Second
	}
	log := r.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r.mu.Lock()
	fresh := r.fresh
	r.mu.Unlock()
	wait := jitter(retry, 0.5, 1.5)
	if fresh {
		wait = jitter(r.renewIn(), 0.9, 1)
	}
	failing := 0
	for {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		if err := r.WriteOnce(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			failing++
			// Once, then every few minutes: the metric counts each.
			if failing == 1 || failing%30 == 0 {
				_, exp, ok := r.InPlace()
				log.Warn("renew the plugin's API credential", "err", err, "retry", retry, "failures", failing,
					"inPlace", ok, "expires", exp)
			}
			wait = jitter(retry, 0.5, 1.5)
			continue
		}
		if failing > 0 {
			log.Info("plugin's API credential renewed after failures", "path", r.Path, "failures", failing)
		} else {
			log.Debug("plugin's API credential renewed", "path", r.Path)
		}
		failing = 0
		wait = jitter(r.renewIn(), 0.9, 1)
	}
}

// jitter is d scaled by a random factor in [lo, hi).
func jitter(d time.Duration, lo, hi float64) time.Duration {
	return time.Duration(float64(d) * (lo + rand.Float64()*(hi-lo)))
}
