package plugincred

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

const ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"

func valid() *File {
	return &File{Server: "https://10.96.0.1:443", CA: ca, Token: "eyJ.a.b", NodeName: "n1",
		Policy:    Policy{ExcludedNamespaces: []string{"kube-system"}, DataPlaneNamespaces: []string{"istio-system"}},
		DaemonSet: &ObjectRef{Namespace: "istio-system", Name: "ambient-cni"}}
}

func TestWriteRead(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	p := filepath.Join(dir, "plugin-credential.json")
	if err := Write(p, valid()); err != nil {
		t.Fatal(err)
	}
	got, err := Read(p)
	if err != nil || got.Token != "eyJ.a.b" || got.Server != "https://10.96.0.1:443" || got.Policy.DataPlaneNamespaces[0] != "istio-system" ||
		got.DaemonSet == nil || *got.DaemonSet != (ObjectRef{Namespace: "istio-system", Name: "ambient-cni"}) {
		t.Fatalf("read back %+v, %v", got, err)
	}
	for path, want := range map[string]os.FileMode{dir: 0o700, p: 0o600} {
		if st, err := os.Stat(path); err != nil || st.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v (%v)", path, st.Mode().Perm(), want, err)
		}
	}
}

// Hostile files: nothing but a root-only regular file of the right shape
// is read, and nothing blocks.
func TestReadHostile(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	if err := Write(good, valid()); err != nil {
		t.Fatal(err)
	}
	cases := map[string]func(p string) error{
		"missing": func(string) error { return nil },
		"fifo":    func(p string) error { return syscall.Mkfifo(p, 0o600) },
		"dir":     func(p string) error { return os.Mkdir(p, 0o700) },
		"symlink": func(p string) error { return os.Symlink(good, p) },
		"world-readable": func(p string) error {
			b, _ := os.ReadFile(good)
			return os.WriteFile(p, b, 0o644)
		},
		"oversized": func(p string) error {
			return os.WriteFile(p, []byte(`{"server":"https://a","token":"`+strings.Repeat("a", MaxBytes)+`"}`), 0o600)
		},
		"empty":     func(p string) error { return os.WriteFile(p, nil, 0o600) },
		"malformed": func(p string) error { return os.WriteFile(p, []byte(`{"server":`), 0o600) },
	}
	for name, mk := range cases {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(dir, name)
			if err := mk(p); err != nil {
				t.Fatal(err)
			}
			if f, err := Read(p); err == nil {
				t.Errorf("read %+v from a %s file", f, name)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for name, mut := range map[string]func(*File){
		"http":             func(f *File) { f.Server = "http://10.96.0.1" },
		"no host":          func(f *File) { f.Server = "https://" },
		"userinfo":         func(f *File) { f.Server = "https://u:p@a" },
		"path":             func(f *File) { f.Server = "https://a/evil" },
		"no CA":            func(f *File) { f.CA = "" },
		"no token":         func(f *File) { f.Token = "" },
		"header injection": func(f *File) { f.Token = "t\r\nX-Evil: 1" },
		"space in token":   func(f *File) { f.Token = "a b" },
		"bad namespace":    func(f *File) { f.Policy.ExcludedNamespaces = []string{""} },
		// The DaemonSet's names become path segments of a request.
		"daemonSet path":        func(f *File) { f.DaemonSet.Name = "../../secrets/x" },
		"daemonSet dot-dot":     func(f *File) { f.DaemonSet.Namespace = ".." },
		"daemonSet no name":     func(f *File) { f.DaemonSet.Name = "" },
		"daemonSet query":       func(f *File) { f.DaemonSet.Name = "a?watch=1" },
		"daemonSet, no node":    func(f *File) { f.NodeName = "" },
		"daemonSet, node slash": func(f *File) { f.NodeName = "n/1" },
	} {
		f := valid()
		mut(f)
		if err := f.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if err := Write(filepath.Join(t.TempDir(), "c"), f); err == nil {
			t.Errorf("%s: written", name)
		}
	}
}

// A file without a DaemonSet (written by an older agent) is still read:
// the fallback then only skips the check that needs it.
func TestReadWithoutDaemonSet(t *testing.T) {
	f := valid()
	f.DaemonSet = nil
	p := filepath.Join(t.TempDir(), "plugin-credential.json")
	if err := Write(p, f); err != nil {
		t.Fatal(err)
	}
	if got, err := Read(p); err != nil || got.DaemonSet != nil {
		t.Fatalf("read back %+v, %v", got, err)
	}
}

func FuzzParse(f *testing.F) {
	fuzzseed.Add(f, "FuzzParse")
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Parse(b)
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("Parse accepted what Validate refuses: %v", err)
		}
		if strings.ContainsAny(c.Token, "\r\n ") || !strings.HasPrefix(c.Server, "https://") {
			t.Fatalf("accepted %+v", c)
		}
	})
}

type tokens struct {
	mu    sync.Mutex
	n     int
	fail  bool
	asked []time.Duration
	// grant, when set, is the lifetime the API server grants (its
	// --service-account-max-token-expiration), whatever was asked.
	grant time.Duration
}

func (s *tokens) Token(_ context.Context, lifetime time.Duration) (Token, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked = append(s.asked, lifetime)
	if s.fail {
		return Token{}, errors.New("API server down")
	}
	s.n++
	t := Token{Value: "tok" + string(rune('a'+s.n))}
	if s.grant > 0 {
		t.Expires = time.Now().Add(s.grant)
	}
	return t, nil
}

func (s *tokens) setFail(fail bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fail = fail
}

func (s *tokens) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// The rotator writes at once, renews after half the lifetime, and after a
// failure retries at the retry interval, never waiting a whole half
// lifetime on a missing token.
func TestRotator(t *testing.T) {
	p := filepath.Join(t.TempDir(), "plugin-credential.json")
	src := &tokens{fail: true}
	r := &Rotator{Path: p, Base: *valid(), Source: src, Lifetime: 200 * time.Millisecond, Retry: 20 * time.Millisecond}
	if err := r.WriteOnce(context.Background()); err == nil {
		t.Fatal("first write succeeded with the API server down")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	src.mu.Lock()
	src.fail = false
	src.mu.Unlock()
	poll.Until(t, "a token after the API server returned", func() bool { return src.count() >= 1 })
	poll.Until(t, "renewals", func() bool { return src.count() >= 3 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	f, err := Read(p)
	if err != nil || !strings.HasPrefix(f.Token, "tok") {
		t.Fatalf("file after renewals: %+v, %v", f, err)
	}
	for _, l := range src.asked {
		if l != r.Lifetime {
			t.Errorf("asked for lifetime %s, want %s", l, r.Lifetime)
		}
	}
}

// jwt is a token shaped as the API server's, with the given claims.
func jwt(iat, exp int64) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc(fmt.Appendf(nil, `{"iat":%d,"exp":%d,"sub":"system:serviceaccount:istio-system:ambient-cni-plugin"}`, iat, exp)) + ".sig"
}

// A server that grants less than asked (its max token expiration) is
// renewed within what it granted: a renewal after half the asked
// lifetime would leave the plugin without a valid token for the rest.
func TestRotatorRenewsWithinGrantedLifetime(t *testing.T) {
	src := &tokens{grant: 200 * time.Millisecond}
	r := &Rotator{Path: filepath.Join(t.TempDir(), "plugin-credential.json"), Base: *valid(), Source: src, Lifetime: 365 * 24 * time.Hour}
	if err := r.WriteOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, exp, ok := r.InPlace(); !ok || time.Until(exp) > time.Second {
		t.Fatalf("expiry in place %v (%v), want the granted one", exp, ok)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	poll.Until(t, "renewals within the granted lifetime", func() bool { return src.count() >= 4 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A long-lived token is still renewed after RenewAfter (a day by
// default), so it always outlasts a long node outage.
func TestRotatorRenewsLongTokensEarly(t *testing.T) {
	src := &tokens{}
	r := &Rotator{Path: filepath.Join(t.TempDir(), "plugin-credential.json"), Base: *valid(), Source: src, Lifetime: 365 * 24 * time.Hour, RenewAfter: 20 * time.Millisecond}
	if err := r.WriteOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	poll.Until(t, "renewals after RenewAfter", func() bool { return src.count() >= 3 })
	cancel()
	<-done
	if DefaultRenewAfter > 24*time.Hour {
		t.Errorf("default renewal %v, want at most a day", DefaultRenewAfter)
	}
}

// Ready, Check and the metric hooks follow what is in place: nothing
// before the first token, every failure counted, the expiry granted.
func TestRotatorReadyAndHooks(t *testing.T) {
	src := &tokens{fail: true}
	var mu sync.Mutex
	var failures int
	var gotExp time.Time
	r := &Rotator{Path: filepath.Join(t.TempDir(), "plugin-credential.json"), Base: *valid(), Source: src, Lifetime: time.Hour, Retry: 10 * time.Millisecond,
		OnFailure:    func(error) { mu.Lock(); failures++; mu.Unlock() },
		OnCredential: func(_, exp time.Time) { mu.Lock(); gotExp = exp; mu.Unlock() }}
	if err := r.WriteOnce(context.Background()); err == nil {
		t.Fatal("a token with the API server down")
	}
	if _, _, ok := r.InPlace(); ok {
		t.Fatal("ready without a credential")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	poll.Until(t, "failures counted", func() bool { mu.Lock(); defer mu.Unlock(); return failures >= 3 })
	src.setFail(false)
	poll.Until(t, "ready once a token is in place", func() bool {
		_, _, ok := r.InPlace()
		return ok
	})
	cancel()
	<-done
	if _, exp, ok := r.InPlace(); !ok || !time.Now().Before(exp) {
		t.Errorf("credential in place %v, expires %v", ok, exp)
	}
	mu.Lock()
	defer mu.Unlock()
	if d := time.Until(gotExp); d < 59*time.Minute || d > time.Hour {
		t.Errorf("expiry reported %v from now, want the hour asked", d)
	}
}

// Without a new token, a valid credential a previous agent left on the
// node is kept (rewritten with this agent's policy), never one that
// expired or belongs to another node or server.
func TestKeepValid(t *testing.T) {
	now := time.Now().Unix()
	for name, c := range map[string]struct {
		token  string
		mutate func(*File)
		keep   bool
	}{
		"valid":          {token: jwt(now-3600, now+3600), keep: true},
		"expired":        {token: jwt(now-7200, now-60)},
		"no expiry":      {token: jwt(now, 0)},
		"not a JWT":      {token: "opaque"},
		"another node":   {token: jwt(now, now+3600), mutate: func(f *File) { f.NodeName = "n2" }},
		"another server": {token: jwt(now, now+3600), mutate: func(f *File) { f.Server = "https://10.96.0.2" }},
	} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "plugin-credential.json")
			old := valid()
			old.Token = c.token
			old.Policy.ExcludedNamespaces = []string{"old"}
			if c.mutate != nil {
				c.mutate(old)
			}
			if err := Write(p, old); err != nil {
				t.Fatal(err)
			}
			r := &Rotator{Path: p, Base: *valid(), Source: &tokens{fail: true}, Lifetime: time.Hour}
			if err := r.WriteOnce(context.Background()); err == nil {
				t.Fatal("a token with the API server down")
			}
			exp, err := r.KeepValid()
			f, rerr := Read(p)
			if rerr != nil {
				t.Fatal(rerr)
			}
			_, inExp, ok := r.InPlace()
			if !c.keep {
				if err == nil || ok || f.Policy.ExcludedNamespaces[0] != "old" {
					t.Fatalf("kept (%v, in place %v): %+v", err, ok, f)
				}
				return
			}
			if err != nil || !ok || !inExp.Equal(exp) || exp.Unix() != now+3600 {
				t.Fatalf("KeepValid = %v, %v; in place %v %v", exp, err, inExp, ok)
			}
			if f.Token != c.token || f.Policy.ExcludedNamespaces[0] != "kube-system" {
				t.Errorf("kept file %+v, want the old token with this agent's policy", f)
			}
			if _, _, ok := r.InPlace(); !ok {
				t.Error("not ready with a kept credential")
			}
		})
	}
}

// TestJitterSpreads: retries and renewals are spread over their window,
// never outside it, so agents started together do not ask together.
func TestJitterSpreads(t *testing.T) {
	for _, c := range []struct{ lo, hi float64 }{{0.5, 1.5}, {0.9, 1}} {
		d := 10 * time.Second
		lo, hi := time.Duration(float64(d)*c.lo), time.Duration(float64(d)*c.hi)
		minSeen, maxSeen := hi, lo
		for range 2000 {
			got := jitter(d, c.lo, c.hi)
			if got < lo || got >= hi {
				t.Fatalf("jitter(%v, %v, %v) = %v, outside [%v, %v)", d, c.lo, c.hi, got, lo, hi)
			}
			minSeen, maxSeen = min(minSeen, got), max(maxSeen, got)
		}
		if spread := maxSeen - minSeen; spread < (hi-lo)*8/10 {
			t.Errorf("jitter(%v, %v, %v) spread over %v of a %v window in 2,000 draws", d, c.lo, c.hi, spread, hi-lo)
		}
	}
}
