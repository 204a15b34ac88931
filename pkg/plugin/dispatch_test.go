package plugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

// dispatchCase is one invocation: the CNI_* variables set and stdin.
type dispatchCase struct {
	name  string
	env   map[string]string
	stdin string
	// verbErr is what the called verb returns.
	verbErr error
}

// addEnv is a complete ADD environment; cases change or drop keys.
func addEnv(cmd string, change map[string]string) map[string]string {
	env := map[string]string{
		"CNI_COMMAND": cmd, "CNI_CONTAINERID": "sb-1_a.b", "CNI_NETNS": "/var/run/netns/none-such",
		"CNI_IFNAME": "eth0", "CNI_PATH": "/opt/cni/bin", "CNI_ARGS": "K8S_POD_NAME=a",
	}
	for k, v := range change {
		if v == "-" {
			delete(env, k)
		} else {
			env[k] = v
		}
	}
	return env
}

const goodConf = `{"cniVersion":"1.1.0","name":"k8s-pod-network","type":"ambient-cni"}`

func dispatchCases() []dispatchCase {
	var cs []dispatchCase
	add := func(name string, env map[string]string, stdin string) {
		cs = append(cs, dispatchCase{name: name, env: env, stdin: stdin})
	}
	add("no command prints about", map[string]string{"CNI_PATH": "/x"}, goodConf)
	add("unknown command", addEnv("FOO", nil), goodConf)
	add("unknown command, bad JSON first", addEnv("FOO", nil), `{`)
	add("unknown command, version not a string is not looked at", addEnv("FOO", nil), `{"name":"n","cniVersion":1}`)
	add("lower-case command", addEnv("add", nil), goodConf)
	add("two commands", addEnv("ADD CHECK", nil), goodConf)
	add("command with spaces", addEnv(" STATUS ", nil), goodConf)
	add("GC STATUS", addEnv("GC STATUS", nil), goodConf)
	for _, cmd := range []string{"ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION"} {
		add(cmd+" ok", addEnv(cmd, nil), goodConf)
		add(cmd+" bare env", map[string]string{"CNI_COMMAND": cmd}, goodConf)
		add(cmd+" no CNI_PATH", addEnv(cmd, map[string]string{"CNI_PATH": "-"}), goodConf)
		add(cmd+" no netns", addEnv(cmd, map[string]string{"CNI_NETNS": "-"}), goodConf)
		add(cmd+" bad container id", addEnv(cmd, map[string]string{"CNI_CONTAINERID": "-x"}), goodConf)
		add(cmd+" bad container id and missing path", addEnv(cmd, map[string]string{"CNI_CONTAINERID": "a/b", "CNI_PATH": "-"}), goodConf)
		add(cmd+" not JSON", addEnv(cmd, nil), `not json`)
		add(cmd+" empty stdin", addEnv(cmd, nil), ``)
		add(cmd+" JSON null", addEnv(cmd, nil), `null`)
		add(cmd+" JSON array", addEnv(cmd, nil), `[1]`)
		add(cmd+" no name", addEnv(cmd, nil), `{"cniVersion":"1.1.0"}`)
		add(cmd+" name not a string", addEnv(cmd, nil), `{"cniVersion":"1.1.0","name":7}`)
		add(cmd+" bad name", addEnv(cmd, nil), `{"cniVersion":"1.1.0","name":"a b"}`)
		add(cmd+" name starting with a dot", addEnv(cmd, nil), `{"cniVersion":"1.1.0","name":".a"}`)
		add(cmd+" non-ASCII name", addEnv(cmd, nil), `{"cniVersion":"1.1.0","name":"né"}`)
		add(cmd+" version not a string", addEnv(cmd, nil), `{"cniVersion":1,"name":"n"}`)
		for _, v := range []string{"", "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "0.5.0", "1.0.0", "1.1.0", "1.2.0", "2", "1.x", "1.1.0.0", "-1"} {
			add(cmd+" cniVersion "+v, addEnv(cmd, nil), `{"cniVersion":"`+v+`","name":"n"}`)
		}
		add(cmd+" no cniVersion", addEnv(cmd, nil), `{"name":"n"}`)
		for _, ifn := range []string{"eth0123456789ab", "eth0123456789abc", ".", "..", "a/b", "a:b", "a b", "a\tb", "né", "a\u00a0b"} {
			add(cmd+" ifname "+ifn, addEnv(cmd, map[string]string{"CNI_IFNAME": ifn}), goodConf)
		}
		add(cmd+" own netns", addEnv(cmd, map[string]string{"CNI_NETNS": "/proc/self/ns/net"}), goodConf)
		for _, o := range []string{"1", "true", "TRUE", "True", "yes", "0"} {
			add(cmd+" own netns, override "+o, addEnv(cmd, map[string]string{"CNI_NETNS": "/proc/self/ns/net", "CNI_NETNS_OVERRIDE": o}), goodConf)
		}
	}
	for _, err := range []error{errors.New("plain failure"), types.NewError(types.ErrTryAgainLater, "later", "d")} {
		for _, cmd := range []string{"ADD", "DEL", "CHECK", "GC", "STATUS"} {
			cs = append(cs, dispatchCase{name: cmd + " verb fails: " + err.Error(), env: addEnv(cmd, nil), stdin: goodConf, verbErr: err})
		}
	}
	return cs
}

// outcome is what one dispatcher made of an invocation.
type outcome struct {
	Called string
	Err    *types.Error
	Stdout string
}

// TestDispatchAsSkel runs every case through skel and through the
// plugin's dispatcher with the same recording verbs: the verb called (if
// any), the error and stdout must be the same. The one intended
// difference: skel refuses the plugin's own netns after ADD or DEL ran,
// the dispatcher before.
func TestDispatchAsSkel(t *testing.T) {
	for _, c := range dispatchCases() {
		t.Run(c.name, func(t *testing.T) {
			want := runSkel(t, c)
			got := runOurs(c)
			if want.Err != nil && want.Err.Code == types.ErrInvalidNetNS && (want.Called == "ADD" || want.Called == "DEL") {
				want.Called = ""
			}
			want.Err, got.Err = decodeErrorShape(want.Err), decodeErrorShape(got.Err)
			if d := cmp.Diff(want, got); d != "" {
				t.Errorf("dispatcher differs from skel (-skel +ours):\n%s", d)
			}
		})
	}
}

// decodeErrorShape drops the JSON decoder's own words from a decoding
// failure: they name the Go type decoded into, which differs.
func decodeErrorShape(e *types.Error) *types.Error {
	if e == nil || e.Code != types.ErrDecodingFailure {
		return e
	}
	c := *e
	if i := strings.Index(c.Msg, ": json: cannot unmarshal "); i >= 0 {
		c.Msg = c.Msg[:i] + ": json: cannot unmarshal ..."
	}
	return &c
}

func recorder(called *string, err error) verbs {
	rec := func(name string) func(*CmdArgs) error {
		return func(*CmdArgs) error { *called = name; return err }
	}
	return verbs{add: rec("ADD"), del: rec("DEL"), check: rec("CHECK"), gc: rec("GC"), status: rec("STATUS")}
}

func runOurs(c dispatchCase) outcome {
	var o outcome
	var stdout, stderr bytes.Buffer
	o.Err = dispatch(func(k string) string { return c.env[k] }, strings.NewReader(c.stdin), &stdout, &stderr, recorder(&o.Called, c.verbErr))
	o.Stdout = stdout.String()
	return o
}

// runSkel runs skel in this process: it reads the real environment and
// os.Stdin and writes os.Stdout, so those are swapped for the call.
func runSkel(t *testing.T, c dispatchCase) outcome {
	for _, k := range []string{"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH", "CNI_NETNS_OVERRIDE"} {
		t.Setenv(k, c.env[k])
	}
	in, err := os.CreateTemp(t.TempDir(), "stdin")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.WriteString(c.stdin); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Seek(0, 0); err != nil {
		t.Fatal(err)
	}
	out, err := os.CreateTemp(t.TempDir(), "stdout")
	if err != nil {
		t.Fatal(err)
	}
	errOut, err := os.CreateTemp(t.TempDir(), "stderr")
	if err != nil {
		t.Fatal(err)
	}
	oldIn, oldOut, oldErr := os.Stdin, os.Stdout, os.Stderr
	os.Stdin, os.Stdout, os.Stderr = in, out, errOut
	var o outcome
	vs := recorder(&o.Called, c.verbErr)
	e := skel.PluginMainFuncsWithError(skel.CNIFuncs{
		Add:    func(a *skel.CmdArgs) error { return vs.add(nil) },
		Del:    func(a *skel.CmdArgs) error { return vs.del(nil) },
		Check:  func(a *skel.CmdArgs) error { return vs.check(nil) },
		GC:     func(a *skel.CmdArgs) error { return vs.gc(nil) },
		Status: func(a *skel.CmdArgs) error { return vs.status(nil) },
	}, version.PluginSupports(SupportedVersions...), About)
	os.Stdin, os.Stdout, os.Stderr = oldIn, oldOut, oldErr
	if e != nil {
		o.Err = e
	}
	b, err := os.ReadFile(out.Name())
	if err != nil {
		t.Fatal(err)
	}
	o.Stdout = string(b)
	return o
}

// TestDispatchArgs checks the verb gets the variables and stdin.
func TestDispatchArgs(t *testing.T) {
	env := addEnv("ADD", map[string]string{"CNI_NETNS_OVERRIDE": "1"})
	var got *CmdArgs
	vs := verbs{add: func(a *CmdArgs) error { got = a; return nil }}
	if e := dispatch(func(k string) string { return env[k] }, strings.NewReader(goodConf), io.Discard, io.Discard, vs); e != nil {
		t.Fatal(e)
	}
	want := &CmdArgs{ContainerID: "sb-1_a.b", Netns: "/var/run/netns/none-such", IfName: "eth0", Args: "K8S_POD_NAME=a", Path: "/opt/cni/bin", NetnsOverride: "1", StdinData: []byte(goodConf)}
	if got.conf == nil || got.conf.Name != "k8s-pod-network" {
		t.Errorf("the decoded config is not handed on: %+v", got.conf)
	}
	if d := cmp.Diff(want, got, cmpopts.IgnoreUnexported(CmdArgs{})); d != "" {
		t.Errorf("args (-want +got):\n%s", d)
	}
}

// endless is a stdin that never ends.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = ' '
	}
	return len(p), nil
}

// TestDispatchHostileStdin: a config larger than any real one, or a stdin
// that never ends, is refused (code 7) after reading at most the limit,
// and no verb runs.
func TestDispatchHostileStdin(t *testing.T) {
	big := goodConf[:len(goodConf)-1] + `,"pad":"` + strings.Repeat("x", maxConfigBytes) + `"}`
	for name, in := range map[string]io.Reader{"oversized": strings.NewReader(big), "endless": endless{}} {
		t.Run(name, func(t *testing.T) {
			var called string
			env := addEnv("ADD", nil)
			e := dispatch(func(k string) string { return env[k] }, in, io.Discard, io.Discard, recorder(&called, nil))
			if e == nil || e.Code != types.ErrInvalidNetworkConfig || called != "" {
				t.Fatalf("got %v, verb %q; want code %d and no verb", e, called, types.ErrInvalidNetworkConfig)
			}
		})
	}
	// Exactly the limit is still read.
	exact := goodConf[:len(goodConf)-1] + `,"pad":"` + strings.Repeat("x", maxConfigBytes-len(goodConf)-9) + `"}`
	if len(exact) != maxConfigBytes {
		t.Fatalf("test config is %d bytes", len(exact))
	}
	var called string
	env := addEnv("ADD", nil)
	if e := dispatch(func(k string) string { return env[k] }, strings.NewReader(exact), io.Discard, io.Discard, recorder(&called, nil)); e != nil || called != "ADD" {
		t.Fatalf("config of exactly the limit: %v, verb %q", e, called)
	}
}

// failingReader fails every read.
type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("broken pipe") }

// TestDispatchStdinError: a stdin that cannot be read is an I/O failure.
func TestDispatchStdinError(t *testing.T) {
	env := addEnv("DEL", nil)
	var called string
	e := dispatch(func(k string) string { return env[k] }, failingReader{}, io.Discard, io.Discard, recorder(&called, nil))
	if e == nil || e.Code != types.ErrIOFailure || called != "" {
		t.Fatalf("got %v, verb %q; want code %d", e, called, types.ErrIOFailure)
	}
}

// TestRunExitAndErrorJSON: Run prints a failure as the spec's error JSON
// on stdout and returns 1; success returns 0.
func TestRunExitAndErrorJSON(t *testing.T) {
	var out, logs bytes.Buffer
	p := New(&out, &logs)
	env := addEnv("ADD", map[string]string{"CNI_IFNAME": "a/b"})
	if code := p.Run(func(k string) string { return env[k] }, strings.NewReader(goodConf)); code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	want := "{\n    \"code\": 4,\n    \"msg\": \"interface name contains / or : or whitespace characters\"\n}"
	if out.String() != want {
		t.Errorf("stdout %q, want %q", out.String(), want)
	}
	out.Reset()
	env = map[string]string{"CNI_COMMAND": "VERSION"}
	if code := p.Run(func(k string) string { return env[k] }, strings.NewReader("")); code != 0 {
		t.Fatalf("VERSION exit %d", code)
	}
	if want := `{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}` + "\n"; out.String() != want {
		t.Errorf("VERSION printed %q, want %q", out.String(), want)
	}
}

// TestValidName matches CNI's ^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$.
func TestValidName(t *testing.T) {
	for s, want := range map[string]bool{"": false, "a": true, "0": true, "A-b_c.d": true, "-a": false, "_a": false, ".a": false, "a b": false, "a/b": false, "é": false, "a\n": false, "a-": true} {
		if got := validName(s); got != want {
			t.Errorf("validName(%q) = %v, want %v", s, got, want)
		}
	}
}

// TestRunConfigErrorOrder: the version is judged before the plugin's own
// keys, as with skel, whether or not the config decodes in one go.
func TestRunConfigErrorOrder(t *testing.T) {
	for stdin, want := range map[string]uint{
		`{"cniVersion":"1.0.0","name":"n","timeout":5}`:                                 types.ErrDecodingFailure,
		`{"cniVersion":"9.9.9","name":"n","timeout":5}`:                                 types.ErrIncompatibleCNIVersion,
		`{"cniVersion":"9.9.9","name":"n","timeout":"5s"}`:                              types.ErrIncompatibleCNIVersion,
		`{"cniVersion":"1.0.0","name":"n","timeout":"forever"}`:                         types.ErrInvalidNetworkConfig,
		`{"cniVersion":"1.0.0","name":"n","agentSocket":"rel"}`:                         types.ErrInvalidNetworkConfig,
		`{"cniVersion":"1.0.0","name":"n","prevResult":{"cniVersion":"1.0.0","ips":7}}`: types.ErrDecodingFailure,
	} {
		var out bytes.Buffer
		env := addEnv("ADD", nil)
		if code := New(&out, io.Discard).Run(func(k string) string { return env[k] }, strings.NewReader(stdin)); code != 1 {
			t.Errorf("%s: exit %d", stdin, code)
			continue
		}
		var e types.Error
		if err := json.Unmarshal(out.Bytes(), &e); err != nil || e.Code != want {
			t.Errorf("%s: printed %s (%v), want code %d", stdin, out.String(), err, want)
		}
	}
}

// FuzzDispatchAsSkel compares the dispatcher with skel on arbitrary
// commands, container ids, interface names and stdin.
func FuzzDispatchAsSkel(f *testing.F) {
	f.Add("ADD", "sb1", "eth0", goodConf)
	f.Add("CHECK", "a.b", "e", `{"cniVersion":"0.4.0","name":"x"}`)
	f.Add("GC", "", "", `{"cniVersion":"1.1.0","name":"x","cni.dev/valid-attachments":[]}`)
	f.Add("STATUS", "-", "a b", `{"name":"x"}`)
	f.Add("VERSION", "", "", `nonsense`)
	f.Add("GC STATUS", "a", "b", goodConf)
	f.Add("DEL", "x", "..", `{"cniVersion":"1.0.0","name":"n","prevResult":{"cniVersion":"1.0.0"}}`)
	f.Fuzz(func(t *testing.T, cmd, id, ifname, stdin string) {
		if strings.ContainsRune(cmd+id+ifname, 0) {
			t.Skip("the environment cannot hold NUL")
		}
		c := dispatchCase{env: addEnv(cmd, map[string]string{"CNI_CONTAINERID": id, "CNI_IFNAME": ifname}), stdin: stdin}
		for k, v := range c.env {
			if v == "" {
				delete(c.env, k)
			}
		}
		want, got := runSkel(t, c), runOurs(c)
		if cmd == "" {
			// skel prints its about text on stderr only; so do we.
			want.Stdout, got.Stdout = "", ""
		}
		want.Err, got.Err = decodeErrorShape(want.Err), decodeErrorShape(got.Err)
		if d := cmp.Diff(want, got); d != "" {
			t.Errorf("dispatcher differs from skel (-skel +ours):\n%s", d)
		}
	})
}
