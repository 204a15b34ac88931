package plugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// fakeAgent is a canned agent on a real Unix socket (pure-logic tests of
// the plugin; the real agent is exercised in pkg/nodeagent and test/cni).
type fakeAgent struct {
	dir, sock string
	mu        sync.Mutex
	events    []ambient.PodEvent
	gcs       []ambient.GCRequest
	logs      []ambient.PluginLog
	answer    func(ambient.PodEvent) (int, ambient.PodEventResponse)
}

func newFakeAgent(t *testing.T, answer func(ambient.PodEvent) (int, ambient.PodEventResponse)) *fakeAgent {
	t.Helper()
	dir := t.TempDir()
	a := &fakeAgent{dir: dir, sock: filepath.Join(dir, "agent.sock"), answer: answer}
	ln, err := net.Listen("unix", a.sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(a.serve)}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return a
}

func (a *fakeAgent) serve(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch r.URL.Path {
	case ambient.PathPodEvent:
		var ev ambient.PodEvent
		_ = json.NewDecoder(r.Body).Decode(&ev)
		a.events = append(a.events, ev)
		code, resp := a.answer(ev)
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(resp)
	case ambient.PathGC:
		var req ambient.GCRequest
		_ = json.NewDecoder(r.Body).Decode(&req)
		a.gcs = append(a.gcs, req)
		_ = json.NewEncoder(w).Encode(ambient.PodEventResponse{Verdict: ambient.VerdictOK})
	case ambient.PathStatus:
		_ = json.NewEncoder(w).Encode(ambient.PodEventResponse{Verdict: ambient.VerdictOK})
	case ambient.PathPluginLog:
		b, _ := io.ReadAll(r.Body)
		l, err := ambient.DecodePluginLog(b)
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			_ = json.NewEncoder(w).Encode(ambient.PodEventResponse{Error: err.Error()})
			return
		}
		a.logs = append(a.logs, *l)
		_ = json.NewEncoder(w).Encode(ambient.PodEventResponse{Verdict: ambient.VerdictOK})
	}
}

func (a *fakeAgent) gotLogs() []ambient.PluginLog {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]ambient.PluginLog(nil), a.logs...)
}

func (a *fakeAgent) got() []ambient.PodEvent {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]ambient.PodEvent(nil), a.events...)
}

func verdict(v ambient.Verdict) func(ambient.PodEvent) (int, ambient.PodEventResponse) {
	return func(ambient.PodEvent) (int, ambient.PodEventResponse) {
		return 200, ambient.PodEventResponse{Verdict: v}
	}
}

const k8sArgs = "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1;K8S_POD_INFRA_CONTAINER_ID=sb1;K8S_POD_UID=0b7c6f0e-1111"

func conf(sock, version string, extra string) []byte {
	prev := prevFor(version)
	return []byte(fmt.Sprintf(`{"cniVersion":%q,"name":"k8s","type":"ambient-cni","agentSocket":%q%s,"prevResult":%s}`, version, sock, extra, prev))
}

// prevFor renders the test prevResult in version's own format: before
// 1.0.0 every IP carries its family as "version".
func prevFor(version string) string {
	prev := strings.Replace(prevV1, `"cniVersion":"1.0.0"`, `"cniVersion":"`+version+`"`, 1)
	if strings.HasPrefix(version, "0.") {
		prev = strings.Replace(prev, `{"interface":1,"address":"fd00`, `{"version":"6","interface":1,"address":"fd00`, 1)
		prev = strings.ReplaceAll(prev, `{"interface":`, `{"version":"4","interface":`)
		// 0.x results always carry a (possibly empty) dns object.
		prev = strings.TrimSuffix(prev, "}") + `,"dns":{}}`
	}
	return prev
}

func run(t *testing.T, verb func(*Plugin) func(*CmdArgs) error, stdin []byte, args string) (string, error) {
	t.Helper()
	var out, logs bytes.Buffer
	p := New(&out, &logs)
	err := verb(p)(&CmdArgs{ContainerID: "sb1", Netns: "/var/run/netns/cni-1", IfName: "eth0", Args: args, StdinData: stdin})
	if logs.Len() > 0 {
		t.Logf("plugin log:\n%s", logs.String())
	}
	return out.String(), err
}

func add(p *Plugin) func(*CmdArgs) error   { return p.Add }
func del(p *Plugin) func(*CmdArgs) error   { return p.Del }
func check(p *Plugin) func(*CmdArgs) error { return p.Check }

func cniCode(t *testing.T, err error) uint {
	t.Helper()
	var te *types.Error
	if !errors.As(err, &te) {
		t.Fatalf("error %v is not a CNI error", err)
	}
	return te.Code
}

// jsonEqual compares two JSON documents by content.
func jsonEqual(t *testing.T, a, b string) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal([]byte(a), &x); err != nil {
		t.Fatalf("decode %q: %v", a, err)
	}
	if err := json.Unmarshal([]byte(b), &y); err != nil {
		t.Fatalf("decode %q: %v", b, err)
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

func TestAddPassesPrevResultThrough(t *testing.T) {
	for _, v := range []ambient.Verdict{ambient.VerdictEnrolled, ambient.VerdictNotEnrolled} {
		a := newFakeAgent(t, verdict(v))
		out, err := run(t, add, conf(a.sock, "1.0.0", ""), k8sArgs)
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		if !jsonEqual(t, out, prevV1) {
			t.Errorf("%s: result %s differs from prevResult %s", v, out, prevV1)
		}
		evs := a.got()
		if len(evs) != 1 {
			t.Fatalf("agent got %d events", len(evs))
		}
		want := ambient.PodEvent{Command: ambient.CommandAdd, PodName: "web-1", PodNamespace: "shop", PodUID: "0b7c6f0e-1111",
			SandboxID: "sb1", Netns: "/var/run/netns/cni-1", IfName: "eth0", IPs: []string{"10.1.0.5", "fd00::5"}, Network: "k8s"}
		if diff := cmp.Diff(want, evs[0]); diff != "" {
			t.Errorf("event (-want +got):\n%s", diff)
		}
	}
}

func TestAddAgentErrors(t *testing.T) {
	a := newFakeAgent(t, func(ambient.PodEvent) (int, ambient.PodEventResponse) {
		return 503, ambient.PodEventResponse{Error: "no ztunnel connected", Retryable: true}
	})
	_, err := run(t, add, conf(a.sock, "1.0.0", ""), k8sArgs)
	if cniCode(t, err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "no ztunnel connected") {
		t.Errorf("retryable agent error gave %v", err)
	}
	c := newFakeAgent(t, func(ambient.PodEvent) (int, ambient.PodEventResponse) { return 500, ambient.PodEventResponse{} })
	_, err = run(t, add, conf(c.sock, "1.0.0", ""), k8sArgs)
	if cniCode(t, err) != types.ErrInternal || !strings.Contains(err.Error(), "HTTP 500") {
		t.Errorf("bare 500 gave %v", err)
	}
}

// TestAgentErrorsNameTheSide: each kind of agent answer maps to the CNI
// error code that names who must act: the runtime's request (4), a retry
// (11), or the agent (999, saying which case).
func TestAgentErrorsNameTheSide(t *testing.T) {
	for _, tc := range []struct {
		status    int
		retryable bool
		verb      func(*Plugin) func(*CmdArgs) error
		code      uint
		msg       string
	}{
		{400, false, add, types.ErrInvalidEnvironmentVariables, "rejected ADD as invalid"},
		{413, false, add, types.ErrInvalidEnvironmentVariables, "rejected ADD as invalid"},
		{400, false, del, types.ErrInvalidEnvironmentVariables, "rejected DEL as invalid"},
		{409, false, check, types.ErrInternal, "CHECK failed"},
		{404, false, add, types.ErrInternal, "same version"},
		{405, false, add, types.ErrInternal, "same version"},
		{403, false, add, types.ErrInternal, "refused ADD"},
		{500, false, add, types.ErrInternal, "node agent failed ADD"},
		{503, true, add, types.ErrTryAgainLater, "could not complete ADD yet"},
		{500, true, add, types.ErrTryAgainLater, "could not complete ADD yet"},
	} {
		a := newFakeAgent(t, func(ambient.PodEvent) (int, ambient.PodEventResponse) {
			return tc.status, ambient.PodEventResponse{Error: "the agent's words", Retryable: tc.retryable}
		})
		_, err := run(t, tc.verb, conf(a.sock, "1.0.0", ""), k8sArgs)
		if cniCode(t, err) != tc.code || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), "the agent's words") {
			t.Errorf("HTTP %d (retryable %v): %v; want code %d saying %q", tc.status, tc.retryable, err, tc.code, tc.msg)
		}
	}
}

func TestAddRejectsBadInput(t *testing.T) {
	a := newFakeAgent(t, verdict(ambient.VerdictEnrolled))
	if _, err := run(t, add, conf(a.sock, "1.0.0", ""), ""); cniCode(t, err) != types.ErrInvalidEnvironmentVariables ||
		!strings.Contains(err.Error(), "K8S_POD_NAME") {
		t.Errorf("missing CNI_ARGS gave %v", err)
	}
	if _, err := run(t, add, conf(a.sock, "1.0.0", ""), "K8S_POD_NAME"); cniCode(t, err) != types.ErrInvalidEnvironmentVariables {
		t.Errorf("malformed CNI_ARGS gave %v", err)
	}
	if _, err := run(t, add, []byte(`{"cniVersion":"1.0.0","name":"k8s","agentSocket":"`+a.sock+`"}`), k8sArgs); cniCode(t, err) != types.ErrInvalidNetworkConfig ||
		!strings.Contains(err.Error(), "prevResult") {
		t.Errorf("missing prevResult gave %v", err)
	}
	if _, err := run(t, add, []byte(`{"cniVersion":"1.0.0",`), k8sArgs); cniCode(t, err) != types.ErrDecodingFailure {
		t.Errorf("malformed config gave %v", err)
	}
	if _, err := run(t, add, conf(a.sock, "1.0.0", ""), "K8S_POD_NAME=Web_1;K8S_POD_NAMESPACE=shop"); cniCode(t, err) != types.ErrInvalidEnvironmentVariables {
		t.Errorf("invalid pod name gave %v", err)
	}
	if n := len(a.got()); n != 0 {
		t.Errorf("agent was asked %d times about bad input", n)
	}
}

func TestAddExcludedNamespaceSkipsAgent(t *testing.T) {
	dir := t.TempDir() // no agent at all
	out, err := run(t, add, conf(filepath.Join(dir, "agent.sock"), "1.0.0", `,"excludedNamespaces":["shop"]`), k8sArgs)
	if err != nil || !jsonEqual(t, out, prevV1) {
		t.Errorf("excluded namespace: %q, %v", out, err)
	}
}

func TestDelSpoolsWhenAgentDown(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	for range 2 {
		if _, err := run(t, del, conf(sock, "1.0.0", ""), k8sArgs); err != nil {
			t.Fatalf("DEL with agent down: %v", err)
		}
	}
	entries, err := nodefiles.List(nodefiles.ForSocket(sock).DelSpool())
	if err != nil || len(entries) != 1 || entries[0].Event == nil {
		t.Fatalf("spool = %+v, %v", entries, err)
	}
	got := *entries[0].Event
	if diff := cmp.Diff(ambient.PodEvent{SandboxID: "sb1", PodUID: "0b7c6f0e-1111", PodName: "web-1"}, ambient.PodEvent{SandboxID: got.SandboxID, PodUID: got.PodUID, PodName: got.PodName}); diff != "" {
		t.Errorf("spooled %+v (-want +got):\n%s", got, diff)
	}
	st, err := os.Stat(entries[0].Path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("spool entry mode %v, %v", st.Mode(), err)
	}
	// DEL without any CNI_ARGS still identifies the sandbox.
	if _, err := run(t, del, conf(sock, "1.0.0", ""), ""); err != nil {
		t.Errorf("bare DEL: %v", err)
	}
}

func TestDelForwarded(t *testing.T) {
	a := newFakeAgent(t, verdict(ambient.VerdictRemoved))
	if _, err := run(t, del, conf(a.sock, "1.0.0", ""), k8sArgs); err != nil {
		t.Fatal(err)
	}
	if evs := a.got(); len(evs) != 1 || evs[0].Command != ambient.CommandDel || evs[0].SandboxID != "sb1" {
		t.Errorf("agent got %+v", evs)
	}
	if entries, _ := nodefiles.List(nodefiles.ForSocket(a.sock).DelSpool()); len(entries) != 0 {
		t.Errorf("DEL spooled although the agent answered")
	}
}

func TestCheck(t *testing.T) {
	a := newFakeAgent(t, func(ambient.PodEvent) (int, ambient.PodEventResponse) {
		return 500, ambient.PodEventResponse{Error: "in-pod rules drifted: ipv4 nat ISTIO_OUTPUT: missing rule #3"}
	})
	if _, err := run(t, check, conf(a.sock, "1.0.0", ""), k8sArgs); err == nil || !strings.Contains(err.Error(), "drifted") {
		t.Errorf("drift not reported: %v", err)
	}
	b := newFakeAgent(t, verdict(ambient.VerdictOK))
	if _, err := run(t, check, conf(b.sock, "1.0.0", ""), k8sArgs); err != nil {
		t.Errorf("clean CHECK: %v", err)
	}
}

func TestStatus(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "agent.sock")
	stdin := []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q}`, sock))
	if _, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.Status }, stdin, ""); err != nil {
		t.Errorf("default STATUS with agent down: %v", err)
	}
	strict := []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q,"statusRequiresAgent":true}`, sock))
	_, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.Status }, strict, "")
	if cniCode(t, err) != types.ErrPluginNotAvailable {
		t.Errorf("strict STATUS with agent down: %v", err)
	}
	a := newFakeAgent(t, verdict(ambient.VerdictOK))
	strict = []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q,"statusRequiresAgent":true}`, a.sock))
	if _, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.Status }, strict, ""); err != nil {
		t.Errorf("strict STATUS with agent up: %v", err)
	}
}

func TestGCForwardsValidAttachments(t *testing.T) {
	a := newFakeAgent(t, verdict(ambient.VerdictOK))
	stdin := []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q,"cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"},{"containerID":"b","ifname":"eth0"},{"containerID":"a","ifname":"net1"}]}`, a.sock))
	if _, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.GC }, stdin, ""); err != nil {
		t.Fatal(err)
	}
	if len(a.gcs) != 1 || strings.Join(a.gcs[0].ValidSandboxIDs, ",") != "a,b" || a.gcs[0].Network != "k8s" {
		t.Errorf("agent got GC %+v", a.gcs)
	}
	// Without the key (not an empty list) nothing is forwarded.
	bare := []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q}`, a.sock))
	if _, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.GC }, bare, ""); err != nil || len(a.gcs) != 1 {
		t.Errorf("GC without valid-attachments: %v, forwarded %d", err, len(a.gcs))
	}
	empty := []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q,"cni.dev/valid-attachments":[]}`, a.sock))
	if _, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.GC }, empty, ""); err != nil || len(a.gcs) != 2 || len(a.gcs[1].ValidSandboxIDs) != 0 {
		t.Errorf("GC with an empty list: %v, forwarded %+v", err, a.gcs)
	}
	// Agent down: GC is skipped, not failed.
	down := []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","agentSocket":%q,"cni.dev/valid-attachments":[]}`, filepath.Join(t.TempDir(), "agent.sock")))
	if _, err := run(t, func(p *Plugin) func(*CmdArgs) error { return p.GC }, down, ""); err != nil {
		t.Errorf("GC with agent down: %v", err)
	}
}

// TestPrevResultOfAnotherVersion: a prevResult in any supported version
// under a config of any other is read by its own version and printed
// converted to the config's (test/cni does it through libcni).
func TestPrevResultOfAnotherVersion(t *testing.T) {
	a := newFakeAgent(t, verdict(ambient.VerdictEnrolled))
	for _, cv := range SupportedVersions {
		for _, pv := range SupportedVersions {
			stdin := []byte(fmt.Sprintf(`{"cniVersion":%q,"name":"k8s","type":"ambient-cni","agentSocket":%q,"prevResult":%s}`, cv, a.sock, prevFor(pv)))
			out, err := run(t, add, stdin, k8sArgs)
			if err != nil {
				t.Errorf("%s prevResult under a %s config: %v", pv, cv, err)
				continue
			}
			var got struct {
				CNIVersion string `json:"cniVersion"`
				IPs        []struct {
					Address string `json:"address"`
				} `json:"ips"`
			}
			if err := json.Unmarshal([]byte(out), &got); err != nil || got.CNIVersion != cv || len(got.IPs) != 3 || got.IPs[0].Address != "10.1.0.5/24" {
				t.Errorf("%s prevResult under a %s config printed %s (%v)", pv, cv, out, err)
			}
		}
	}
	if ev := a.got(); len(ev) == 0 || strings.Join(ev[len(ev)-1].IPs, ",") != "10.1.0.5,fd00::5" {
		t.Errorf("the agent was not told the pod's addresses: %+v", ev)
	}
}

func TestVersionConversion(t *testing.T) {
	for _, v := range SupportedVersions {
		a := newFakeAgent(t, verdict(ambient.VerdictEnrolled))
		out, err := run(t, add, conf(a.sock, v, ""), k8sArgs)
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		var got struct {
			CNIVersion string `json:"cniVersion"`
			IPs        []struct {
				Version string `json:"version"`
			} `json:"ips"`
		}
		if err := json.Unmarshal([]byte(out), &got); err != nil || got.CNIVersion != v || len(got.IPs) != 3 {
			t.Fatalf("%s: result %s (%v)", v, out, err)
		}
		if !jsonEqual(t, out, prevFor(v)) {
			t.Errorf("%s: result %s differs from prevResult %s", v, out, prevFor(v))
		}
		// 0.3.x/0.4.0 results carry a per-IP "version"; 1.x dropped it.
		if hasVer := got.IPs[0].Version != ""; hasVer != strings.HasPrefix(v, "0.") {
			t.Errorf("%s: result not in that version's format: %s", v, out)
		}
	}
}

// TestPassThroughSameVersionIsByteExact: a prevResult in the config's own
// version is printed exactly as it came (keys the library does not know
// included); one in another version is converted.
func TestPassThroughSameVersionIsByteExact(t *testing.T) {
	a := newFakeAgent(t, verdict(ambient.VerdictNotEnrolled))
	prev := strings.Replace(prevV1, `"cniVersion":"1.0.0",`, `"cniVersion":"1.0.0", "x-extra":{"k":[1,2]},`, 1)
	stdin := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s","type":"ambient-cni","agentSocket":%q,"prevResult":%s}`, a.sock, prev))
	out, err := run(t, add, stdin, k8sArgs)
	if err != nil {
		t.Fatal(err)
	}
	if out != prev {
		t.Errorf("printed %s, want prevResult byte for byte %s", out, prev)
	}
	stdin = []byte(fmt.Sprintf(`{"cniVersion":"1.1.0","name":"k8s","type":"ambient-cni","agentSocket":%q,"prevResult":%s}`, a.sock, prev))
	out, err = run(t, add, stdin, k8sArgs)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "x-extra") || !strings.Contains(out, `"cniVersion": "1.1.0"`) {
		t.Errorf("a 1.0.0 prevResult under a 1.1.0 config printed %s; want it converted", out)
	}
}

// TestBadPrevResultInConfigVersion: the fast path still refuses what it
// reads and cannot parse.
func TestBadPrevResultInConfigVersion(t *testing.T) {
	for name, prev := range map[string]string{
		"address not a CIDR":   `{"cniVersion":"1.0.0","ips":[{"address":"nope"}]}`,
		"address not string":   `{"cniVersion":"1.0.0","ips":[{"address":5}]}`,
		"ips not a list":       `{"cniVersion":"1.0.0","ips":{}}`,
		"interface not number": `{"cniVersion":"1.0.0","ips":[{"interface":"0","address":"10.0.0.1/24"}]}`,
		"not an object":        `[1]`,
	} {
		_, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"n","prevResult":` + prev + `}`))
		var te *types.Error
		if !errors.As(err, &te) || te.Code != types.ErrDecodingFailure {
			t.Errorf("%s: got %v, want code %d", name, err, types.ErrDecodingFailure)
		}
	}
}

// The plugin's own log lines, and the error it returns to the runtime,
// reach the agent after the call (its log shows the plugin's side of a
// failure); a quiet successful call sends nothing.
func TestPluginLogReachesAgent(t *testing.T) {
	a := newFakeAgent(t, verdict(ambient.VerdictNotEnrolled))
	if _, err := run(t, add, conf(a.sock, "1.0.0", ""), k8sArgs); err != nil {
		t.Fatal(err)
	}
	if l := a.gotLogs(); len(l) != 0 {
		t.Fatalf("a quiet ADD at the default level sent %v", l)
	}
	// At info the verdict is logged, and sent with the call's attributes.
	if _, err := run(t, add, conf(a.sock, "1.0.0", `,"logLevel":"info"`), k8sArgs); err != nil {
		t.Fatal(err)
	}
	l := a.gotLogs()
	if len(l) != 1 || len(l[0].Records) == 0 {
		t.Fatalf("logs sent: %v, want one call's", l)
	}
	r := l[0].Records[len(l[0].Records)-1]
	attrs := strings.Join(r.Attrs, " ")
	if r.Level != "INFO" || r.Msg != "agent verdict" || !strings.Contains(attrs, "sandbox sb1") || !strings.Contains(attrs, "pod shop/web-1") || !strings.Contains(attrs, "verdict not-enrolled") {
		t.Errorf("record %+v, want the verdict with the call's sandbox and pod", r)
	}
	// A failed ADD sends the error it returns.
	b := newFakeAgent(t, func(ambient.PodEvent) (int, ambient.PodEventResponse) {
		return 503, ambient.PodEventResponse{Error: "no ztunnel connected", Retryable: true}
	})
	if _, err := run(t, add, conf(b.sock, "1.0.0", ""), k8sArgs); err == nil {
		t.Fatal("ADD succeeded")
	}
	l = b.gotLogs()
	if len(l) != 1 {
		t.Fatalf("logs sent: %v", l)
	}
	last := l[0].Records[len(l[0].Records)-1]
	if last.Level != "ERROR" || len(last.Attrs) != 2 || !strings.Contains(last.Attrs[1], "no ztunnel connected") {
		t.Errorf("last record %+v, want the call's error", last)
	}
}

// Logging to the agent never changes a call's outcome: with no agent
// (nothing listening) the ADD fails as it would have, with its own error.
func TestPluginLogNoAgent(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	_, err := run(t, add, conf(sock, "1.0.0", `,"agentUnreachable":"fail-closed"`), k8sArgs)
	if cniCode(t, err) != types.ErrTryAgainLater {
		t.Errorf("ADD with no agent: %v, want the fail-closed retry", err)
	}
}

// A call that logs more than the agent takes sends the first records only.
func TestLogRecorderBounds(t *testing.T) {
	rec := &logRecorder{}
	log := slog.New(&teeHandler{h: slog.NewTextHandler(io.Discard, nil), rec: rec}).With("k", strings.Repeat("v", 5000))
	for i := range ambient.MaxPluginLogRecords + 5 {
		log.WithGroup("g").Info(strings.Repeat("m", 3000), "i", i)
	}
	if len(rec.recs) == 0 || len(rec.recs) >= ambient.MaxPluginLogRecords || rec.size > maxRecordedBytes+2*maxRecordedText {
		t.Fatalf("%d records of %d bytes kept, want the size budget (%d) to stop it", len(rec.recs), rec.size, maxRecordedBytes)
	}
	small := &logRecorder{}
	for range ambient.MaxPluginLogRecords + 5 {
		small.add(slog.LevelWarn, "m", nil)
	}
	if len(small.recs) != ambient.MaxPluginLogRecords {
		t.Errorf("%d small records kept, want %d", len(small.recs), ambient.MaxPluginLogRecords)
	}
	body, err := json.Marshal(ambient.PluginLog{Records: rec.recs})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ambient.DecodePluginLog(body); err != nil {
		t.Fatalf("the agent refuses what the plugin sends: %v", err)
	}
	if got := rec.recs[0].Attrs; got[0] != "k" || got[2] != "g.i" || got[3] != "0" {
		t.Errorf("attrs %q, want k, then g.i 0", got[:4])
	}
}
