package nodeagent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// peerHelperEnv makes the test binary act as a plugin-side client instead
// of running tests; the non-root peer test execs it under another uid.
const peerHelperEnv = "AMBIENT_NODEAGENT_PEER_HELPER_SOCKET"

func TestMain(m *testing.M) {
	if sock := os.Getenv(peerHelperEnv); sock != "" {
		c := &ambient.Client{Socket: sock}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := c.PodEvent(ctx, &ambient.PodEvent{Command: ambient.CommandAdd, PodName: "web", PodNamespace: "shop",
			SandboxID: "sb-peer", Netns: os.Getenv(peerHelperEnv + "_NETNS")})
		if err != nil {
			fmt.Println("ERR", err)
			os.Exit(3)
		}
		_ = json.NewEncoder(os.Stdout).Encode(resp)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type serverHarness struct {
	*harness
	srv    *Server
	sock   string
	layout nodefiles.Layout
}

// newServer starts an event server for a fresh agent. roots nil means
// the default netns roots.
func newServer(t *testing.T, roots []string, tweak func(*ServerConfig)) *serverHarness {
	t.Helper()
	h := newHarness(t)
	sock := filepath.Join(h.dir, "run", "agent.sock")
	cfg := ServerConfig{Layout: nodefiles.ForSocket(sock), Netns: netns.Policy{Roots: roots}, ReadHeaderTimeout: 300 * time.Millisecond, ReadTimeout: 500 * time.Millisecond,
		HandlerTimeout: 5 * time.Second}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := NewServer(cfg, h.kube.Cache, h.agent)
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &serverHarness{harness: h, srv: srv, sock: cfg.Layout.AgentSocket(), layout: cfg.Layout}
}

func (s *serverHarness) send(t *testing.T, ev *ambient.PodEvent) (*ambient.PodEventResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return (&ambient.Client{Socket: s.sock}).PodEvent(ctx, ev)
}

// raw sends bytes on a fresh connection and returns the status line and
// body of the answer.
func (s *serverHarness) raw(t *testing.T, req string) (string, string) {
	t.Helper()
	c, err := net.Dial("unix", s.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	st, body, err := ambient.ReadResponse(bufio.NewReader(c))
	if err != nil {
		return "", "read error: " + err.Error()
	}
	return fmt.Sprint(st), string(body)
}

func addEvent(netns string) *ambient.PodEvent {
	return &ambient.PodEvent{Command: ambient.CommandAdd, PodName: "web", PodNamespace: "shop", PodUID: "u1", SandboxID: "sb1", Netns: netns, IPs: []string{"10.9.0.5"}}
}

func TestServerEndToEnd(t *testing.T) {
	s := newServer(t, nil, nil)
	pn := testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "web", "u1", nil))

	st, err := os.Stat(filepath.Dir(s.sock))
	if err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("socket dir mode %v, %v", st.Mode(), err)
	}
	if st, err := os.Stat(s.sock); err != nil || st.Mode().Perm() != 0o600 || st.Mode().Type() != os.ModeSocket {
		t.Errorf("socket mode %v, %v", st.Mode(), err)
	}
	resp, err := s.send(t, addEvent(pn.Path()))
	if err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Fatalf("ADD = %+v, %v", resp, err)
	}
	check := addEvent(pn.Path())
	check.Command = ambient.CommandCheck
	if resp, err := s.send(t, check); err != nil || resp.Verdict != ambient.VerdictOK {
		t.Fatalf("CHECK = %+v, %v", resp, err)
	}
	if err := (&ambient.Client{Socket: s.sock}).Status(context.Background()); err != nil {
		t.Errorf("STATUS: %v", err)
	}
	// DEL ignores the netns path: the runtime may have removed it already.
	del := &ambient.PodEvent{Command: ambient.CommandDel, SandboxID: "sb1", Netns: "/gone/netns"}
	for range 2 {
		if resp, err := s.send(t, del); err != nil || resp.Verdict != ambient.VerdictRemoved {
			t.Fatalf("DEL = %+v, %v", resp, err)
		}
	}
	if len(s.agent.Pods()) != 0 {
		t.Errorf("pod still enrolled after DEL")
	}
	gc, err := (&ambient.Client{Socket: s.sock}).GC(context.Background(), &ambient.GCRequest{ValidSandboxIDs: []string{}})
	if err != nil || gc.Verdict != ambient.VerdictOK {
		t.Errorf("GC = %+v, %v", gc, err)
	}
}

func TestServerRetryableAnswer(t *testing.T) {
	s := newServer(t, nil, nil)
	pn := testnet.NewNS(t)
	// The pod is unknown to the API server: the agent says "retry".
	resp, err := s.send(t, addEvent(pn.Path()))
	if err != nil || resp.Error == "" || !resp.Retryable || !strings.Contains(resp.Error, `pods "web" not found`) {
		t.Fatalf("ADD of unknown pod = %+v, %v", resp, err)
	}
}

func TestServerSocketReplacement(t *testing.T) {
	testnet.RequireRoot(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	// A stale socket is replaced ...
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = ln.Close()
	h := newHarness(t)
	srv := NewServer(ServerConfig{Layout: nodefiles.ForSocket(sock)}, h.kube.Cache, h.agent)
	if err := srv.Listen(); err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	_ = srv.Close()
	// ... any other file is not.
	file := filepath.Join(dir, "file.sock")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	srv = NewServer(ServerConfig{Layout: nodefiles.ForSocket(file)}, h.kube.Cache, h.agent)
	if err := srv.Listen(); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("regular file at the socket path: %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "keep me" {
		t.Errorf("regular file changed")
	}
	// An old agent stopping after a newer one took over the path leaves
	// the newer one's socket alone.
	shared := filepath.Join(dir, "shared.sock")
	older := NewServer(ServerConfig{Layout: nodefiles.ForSocket(shared)}, h.kube.Cache, h.agent)
	if err := older.Listen(); err != nil {
		t.Fatal(err)
	}
	newer := NewServer(ServerConfig{Layout: nodefiles.ForSocket(shared)}, h.kube.Cache, h.agent)
	if err := newer.Listen(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = newer.Serve(context.Background()) }()
	_ = older.Close()
	if err := (&ambient.Client{Socket: shared}).Status(context.Background()); err != nil {
		t.Errorf("newer agent unreachable after the older one stopped: %v", err)
	}
	_ = newer.Close()
	if _, err := os.Lstat(shared); !os.IsNotExist(err) {
		t.Errorf("socket left after the last agent stopped: %v", err)
	}
	// A loose directory is tightened.
	loose := filepath.Join(dir, "loose")
	if err := os.Mkdir(loose, 0o777); err != nil {
		t.Fatal(err)
	}
	srv = NewServer(ServerConfig{Layout: nodefiles.ForSocket(filepath.Join(loose, "a.sock"))}, h.kube.Cache, h.agent)
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if st, _ := os.Stat(loose); st.Mode().Perm() != 0o700 {
		t.Errorf("socket dir left at %v", st.Mode().Perm())
	}
}

func TestServerRejectsMalformedRequests(t *testing.T) {
	s := newServer(t, nil, nil)
	pn := testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "web", "u1", nil))
	good, _ := json.Marshal(addEvent(pn.Path()))
	post := func(path, body string) string {
		return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
	}
	for name, tc := range map[string]struct {
		req, status, msg string
	}{
		"garbage bytes":     {"\x00\x01\x02garbage\r\n\r\n", "400", ""},
		"not json":          {post(ambient.PathPodEvent, "hello"), "400", "decode request"},
		"json array":        {post(ambient.PathPodEvent, "[1,2]"), "400", "decode request"},
		"unknown field":     {post(ambient.PathPodEvent, strings.Replace(string(good), `{`, `{"extra":1,`, 1)), "400", "unknown field"},
		"trailing data":     {post(ambient.PathPodEvent, string(good)+"{}"), "400", "after the JSON"},
		"wrong type":        {post(ambient.PathPodEvent, `{"command":"ADD","ips":"10.0.0.1"}`), "400", "decode request"},
		"bad command":       {post(ambient.PathPodEvent, strings.Replace(string(good), `"ADD"`, `"RM"`, 1)), "400", "command"},
		"bad pod name":      {post(ambient.PathPodEvent, strings.Replace(string(good), `"web"`, `"../etc"`, 1)), "400", "podName"},
		"bad ip":            {post(ambient.PathPodEvent, strings.Replace(string(good), `10.9.0.5`, `10.9.0.500`, 1)), "400", "ips"},
		"oversized":         {post(ambient.PathPodEvent, `{"podName":"`+strings.Repeat("a", ambient.MaxRequestBytes)+`"}`), "413", "exceeds"},
		"GET pod-event":     {"GET " + ambient.PathPodEvent + " HTTP/1.1\r\nHost: a\r\n\r\n", "405", "POST"},
		"POST status":       {post(ambient.PathStatus, "{}"), "405", "GET"},
		"unknown path":      {post("/v1/other", "{}"), "404", ""},
		"huge headers":      {"POST " + ambient.PathPodEvent + " HTTP/1.1\r\nHost: a\r\nX: " + strings.Repeat("a", 64<<10) + "\r\n\r\n", "431", ""},
		"gc without list":   {post(ambient.PathGC, `{}`), "400", "validSandboxIDs"},
		"gc bad id":         {post(ambient.PathGC, `{"validSandboxIDs":["a b"]}`), "400", "sandboxID"},
		"gc unknown field":  {post(ambient.PathGC, `{"validSandboxIDs":[],"all":true}`), "400", "unknown field"},
		"plugin log empty":  {post(ambient.PathPluginLog, `{"records":[]}`), "400", "records"},
		"plugin log level":  {post(ambient.PathPluginLog, `{"records":[{"level":"LOUD","msg":"x"}]}`), "400", "level"},
		"plugin log attrs":  {post(ambient.PathPluginLog, `{"records":[{"level":"WARN","msg":"x","attrs":["odd"]}]}`), "400", "attrs"},
		"plugin log key":    {post(ambient.PathPluginLog, `{"records":[{"level":"WARN","msg":"x","attrs":["a key","v"]}]}`), "400", "attrs"},
		"plugin log long":   {post(ambient.PathPluginLog, `{"records":[{"level":"WARN","msg":"`+strings.Repeat("m", 2000)+`"}]}`), "400", "msg"},
		"GET plugin log":    {"GET " + ambient.PathPluginLog + " HTTP/1.1\r\nHost: a\r\n\r\n", "405", "POST"},
		"chunked oversized": {"POST " + ambient.PathPodEvent + " HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(ambient.MaxRequestBytes+10), "413", "exceeds"},
	} {
		st, body := s.raw(t, tc.req)
		if st != tc.status || !strings.Contains(body, tc.msg) {
			t.Errorf("%s: got %s %q, want %s containing %q", name, st, truncate(body), tc.status, tc.msg)
		}
	}
	if ops := s.rules.ops(); ops != "" {
		t.Errorf("malformed requests reached the rules: %q", ops)
	}
}

func chunked(n int) string {
	var b strings.Builder
	for n > 0 {
		c := min(n, 4096)
		fmt.Fprintf(&b, "%x\r\n%s\r\n", c, strings.Repeat("a", c))
		n -= c
	}
	b.WriteString("0\r\n\r\n")
	return b.String()
}

func truncate(s string) string {
	if len(s) > 120 {
		return s[:120] + "..."
	}
	return s
}

func TestServerSlowClients(t *testing.T) {
	s := newServer(t, nil, nil)
	dial := func() net.Conn {
		c, err := net.Dial("unix", s.sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	// Headers that never finish, and a body that never arrives.
	slowHeader := dial()
	_, _ = io.WriteString(slowHeader, "POST "+ambient.PathPodEvent+" HTTP/1.1\r\nHost: a\r\n")
	slowBody := dial()
	_, _ = io.WriteString(slowBody, "POST "+ambient.PathPodEvent+" HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{\"comm")
	idle := dial() // connects, sends nothing

	// Meanwhile a well-behaved client is served.
	if err := (&ambient.Client{Socket: s.sock}).Status(context.Background()); err != nil {
		t.Errorf("STATUS while slow clients hang: %v", err)
	}
	for name, c := range map[string]net.Conn{"slow header": slowHeader, "slow body": slowBody, "idle": idle} {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		start := time.Now()
		_, err := io.ReadAll(c)
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Errorf("%s: server kept the connection open for %s", name, time.Since(start))
		}
	}
	if ops := s.rules.ops(); ops != "" {
		t.Errorf("slow requests reached the rules: %q", ops)
	}
}

func TestServerNetnsPolicy(t *testing.T) {
	testnet.RequireRoot(t)
	allowed := t.TempDir()
	s := newServer(t, []string{allowed}, nil)
	s.kube.SetPod(pod("shop", "web", "u1", nil))
	outside := testnet.NewNS(t) // under the runtime dir, not under allowed

	// A regular file under an allowed root.
	plain := filepath.Join(allowed, "plain")
	if err := os.WriteFile(plain, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// A namespace of the wrong type under an allowed root.
	uts := filepath.Join(allowed, "uts")
	if err := os.WriteFile(uts, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc/self/ns/uts", uts, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount a uts namespace: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(uts, unix.MNT_DETACH) })
	// A symlink under the root that leads outside it.
	escape := filepath.Join(allowed, "escape")
	if err := os.Symlink(outside.Path(), escape); err != nil {
		t.Fatal(err)
	}
	// A real netns bind-mounted under the root, and a symlink from
	// elsewhere into it.
	inside := filepath.Join(allowed, "pod-ns")
	if err := os.WriteFile(inside, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(outside.Path(), inside, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount netns: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(inside, unix.MNT_DETACH) })
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(inside, link); err != nil {
		t.Fatal(err)
	}

	for name, tc := range map[string]struct{ path, msg string }{
		"outside roots":   {outside.Path(), "not under an allowed root"},
		"not nsfs":        {plain, "not an nsfs mount"},
		"wrong ns type":   {uts, "not a network namespace"},
		"symlink escape":  {escape, "not under an allowed root"},
		"relative":        {"pod-ns", "not absolute"},
		"missing":         {filepath.Join(allowed, "nope"), "does not exist"},
		"dotdot escape":   {allowed + "/../" + filepath.Base(allowed) + "/../x", "does not exist"},
		"host via proc":   {fmt.Sprintf("/proc/%d/ns/net", os.Getpid()), "host network namespace"},
		"proc self":       {"/proc/self/ns/net", ""},
		"proc not net":    {fmt.Sprintf("/proc/%d/ns/uts", os.Getpid()), ""},
		"the root itself": {allowed, "not under an allowed root"},
	} {
		resp, err := s.send(t, addEvent(tc.path))
		if err != nil || resp.Error == "" || resp.Retryable || !strings.Contains(resp.Error, tc.msg) {
			t.Errorf("%s (%s): %+v, %v; want a permanent error containing %q", name, tc.path, resp, err, tc.msg)
		}
	}
	if ops := s.rules.ops(); ops != "" {
		t.Fatalf("rejected netns paths reached the rules: %q", ops)
	}
	for name, path := range map[string]string{"bind mount under root": inside, "symlink into root": link} {
		resp, err := s.send(t, addEvent(path))
		if err != nil || resp.Verdict != ambient.VerdictEnrolled {
			t.Errorf("%s: %+v, %v", name, resp, err)
		}
	}
	// /proc/<pid>/ns/net of a process inside a pod netns.
	testnet.RequireCommands(t, "ip", "sleep")
	cmd := exec.Command("ip", "netns", "exec", filepath.Base(outside.Path()), "sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	procPath := fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)
	ok := false
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		// ip netns exec switches namespaces before exec'ing sleep.
		if n, err := netns.Open(procPath); err == nil {
			ok = n.SameAs(openNS(t, outside))
			_ = n.Close()
			if ok {
				break
			}
		}
	}
	if !ok {
		t.Fatalf("process never entered the pod netns")
	}
	if resp, err := s.send(t, addEvent(procPath)); err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Errorf("/proc/<pid>/ns/net: %+v, %v", resp, err)
	}
}

func TestServerRefusesNonRootPeer(t *testing.T) {
	testnet.RequireRoot(t)
	// The helper (this test binary, run as nobody) needs to reach both the
	// binary and the socket; t.TempDir's parents are private.
	shared, err := os.MkdirTemp("", "ambient-peer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(shared) })
	if err := os.Chmod(shared, 0o755); err != nil {
		t.Fatal(err)
	}
	s := newServer(t, nil, func(c *ServerConfig) { c.Layout = nodefiles.ForSocket(filepath.Join(shared, "run", "agent.sock")) })
	pn := testnet.NewNS(t)
	s.kube.SetPod(pod("shop", "web", "u1", nil))
	// Loosen the file modes so only SO_PEERCRED stands in the way.
	if err := os.Chmod(filepath.Dir(s.sock), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(s.sock, 0o666); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(shared, "peer-helper")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{peerHelperEnv + "=" + s.sock, peerHelperEnv + "_NETNS=" + pn.Path()}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper as uid 65534: %v\n%s", err, out)
	}
	var resp ambient.PodEventResponse
	if err := json.Unmarshal(out, &resp); err != nil {
		t.Fatalf("helper output %q: %v", out, err)
	}
	if resp.Verdict != "" || !strings.Contains(resp.Error, "peer uid 65534 is not root") {
		t.Errorf("non-root peer got %+v", resp)
	}
	if ops := s.rules.ops(); ops != "" || len(s.agent.Pods()) != 0 {
		t.Errorf("non-root request changed state: rules %q, pods %v", ops, s.agent.Pods())
	}
	// The same request as root goes through.
	if resp, err := s.send(t, addEvent(pn.Path())); err != nil || resp.Verdict != ambient.VerdictEnrolled {
		t.Errorf("root peer: %+v, %v", resp, err)
	}
}

// TestServerErrorsNameTheSide: every way a request can fail answers with
// the status that names its side. A netns path from the runtime that
// cannot name a network namespace is the caller's (400), never a 500, and
// never hangs the handler (a FIFO); a CHECK that finds the pod's capture
// wrong is a 409; an unknown endpoint a JSON 404.
func TestServerErrorsNameTheSide(t *testing.T) {
	testnet.RequireRoot(t)
	allowed := t.TempDir()
	s := newServer(t, []string{allowed}, nil)
	s.kube.SetPod(pod("shop", "web", "u1", nil))
	mk := func(name string, f func(string) error) string {
		p := filepath.Join(allowed, name)
		if err := f(p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	file := mk("file", func(p string) error { return os.WriteFile(p, nil, 0o600) })
	fifo := mk("fifo", func(p string) error { return unix.Mkfifo(p, 0o600) })
	dir := mk("dir", func(p string) error { return os.Mkdir(p, 0o700) })
	loop := mk("loop", func(p string) error { return os.Symlink(p, p) })
	sockPath := mk("sock", func(p string) error {
		ln, err := net.Listen("unix", p)
		if err == nil {
			t.Cleanup(func() { _ = ln.Close() })
		}
		return err
	})
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	// HTTP/1.0, as the plugin speaks it: long answers come unchunked.
	post := func(body []byte) string {
		return fmt.Sprintf("POST %s HTTP/1.0\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s", ambient.PathPodEvent, len(body), body)
	}
	for name, path := range map[string]string{
		"missing":               filepath.Join(allowed, "nope"),
		"file as a directory":   file + "/x",
		"symlink loop":          loop,
		"fifo":                  fifo,
		"directory":             dir,
		"socket":                sockPath,
		"regular file":          file,
		"exited process":        fmt.Sprintf("/proc/%d/ns/net", gone.Process.Pid),
		"outside the roots":     "/etc/hostname",
		"too long":              "/" + strings.Repeat("a/", 2000) + "x",
		"the agent's own netns": "/proc/self/ns/net",
	} {
		body, _ := json.Marshal(addEvent(path))
		done := make(chan struct{})
		var st, msg string
		go func() { st, msg = s.raw(t, post(body)); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatalf("%s: no answer", name)
		}
		if st != "400" {
			t.Errorf("%s (%s): HTTP %s %s; want 400: the runtime's netns path is at fault", name, truncate(path), st, truncate(msg))
		}
	}

	if ops := s.rules.ops(); ops != "" {
		t.Errorf("failed requests reached the rules: %q", ops)
	}

	// CHECK of a pod that should be captured but is not: a finding (the
	// default roots hold the test's namespaces).
	d := newServer(t, nil, nil)
	d.kube.SetPod(pod("shop", "web", "u1", nil))
	pn := testnet.NewNS(t)
	check := addEvent(pn.Path())
	check.Command = ambient.CommandCheck
	body, _ := json.Marshal(check)
	if st, msg := d.raw(t, post(body)); st != "409" || !strings.Contains(msg, "should be captured") {
		t.Errorf("CHECK of an unenrolled pod: HTTP %s %s; want 409", st, msg)
	}
	if st, msg := s.raw(t, "POST /v2/pod-event HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"); st != "404" || !strings.Contains(msg, `"error"`) {
		t.Errorf("unknown endpoint: HTTP %s %s; want a JSON 404", st, msg)
	}
}

// The plugin's log records land in the agent's log, marked as the
// plugin's, with their level and attributes.
func TestPluginLogInAgentLog(t *testing.T) {
	var buf syncBuffer
	s := newServer(t, nil, func(c *ServerConfig) { c.Logger = slog.New(slog.NewTextHandler(&buf, nil)) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := (&ambient.Client{Socket: s.sock}).PluginLog(ctx, &ambient.PluginLog{Records: []ambient.PluginLogRecord{
		{Level: "WARN", Msg: "node agent unreachable; failing closed", Attrs: []string{"sandbox", "sb1", "pod", "shop/web"}},
		{Level: "DEBUG", Msg: "below the agent's level"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	got := buf.String()
	if !strings.Contains(got, `level=WARN msg="node agent unreachable; failing closed" component=cni-plugin sandbox=sb1 pod=shop/web`) {
		t.Errorf("agent log lacks the plugin's record:\n%s", got)
	}
	if strings.Contains(got, "below the agent's level") {
		t.Errorf("a DEBUG record passed the agent's info level:\n%s", got)
	}
}

// syncBuffer is a bytes.Buffer safe for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
