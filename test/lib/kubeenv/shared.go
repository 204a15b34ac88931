package kubeenv

import (
	"context"
	"sync"
	"testing"
	"time"
)

// Shared is one Env for every test of a package, started by the first test
// that asks for it and stopped when the package's tests end:
//
//	var kube kubeenv.Shared
//
//	func TestMain(m *testing.M) { os.Exit(kube.Run(m)) }
//
//	func TestSomething(t *testing.T) {
//		env := kube.Env(t)
//		...
//	}
//
// Tests that share it must not collide on names (namespaces, nodes).
type Shared struct {
	// Options are used for the Launch; set them before Run.
	Options Options

	mu      sync.Mutex
	running bool // inside Run
	env     *Env
	err     error // the failed start, reported to every later caller
}

// Run runs the package's tests, then stops the Env if one was started.
// Call it from TestMain and pass its result to os.Exit.
func (s *Shared) Run(m *testing.M) int {
	s.mu.Lock()
	s.running = true
	s.mu.Unlock()
	code := m.Run()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.running = false
	if s.env != nil {
		s.env.Stop()
		s.env = nil
	}
	return code
}

// Env returns the package's Env, starting it on first use. It skips the
// test (fails it under CI=true) when the binaries are not built, and fails
// it when the Env could not start (every later caller gets the same error
// without another attempt).
func (s *Shared) Env(t testing.TB) *Env {
	t.Helper()
	RequireTool(t, Etcd)
	RequireTool(t, KubeAPIServer)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		t.Fatal("kubeenv.Shared.Env called outside Shared.Run: call it from TestMain so the Env is stopped")
	}
	if s.env == nil && s.err == nil {
		opts := s.Options
		if opts.Logf == nil {
			opts.Logf = t.Logf
		}
		s.env, s.err = Launch(context.Background(), opts)
		if s.err == nil {
			t.Logf("kubeenv: shared etcd + kube-apiserver ready in %v at %s", s.env.StartTime.Round(time.Millisecond), s.env.Config.Host)
		}
	}
	if s.err != nil {
		t.Fatalf("start shared kube-apiserver: %v", s.err)
	}
	return s.env
}
