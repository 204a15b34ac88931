package plugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"unicode"

	"github.com/containernetworking/cni/pkg/types"
)

// The dispatcher below is the plugin's main: it reads the runtime's CNI
// environment and stdin, negotiates the spec version and calls the verb,
// as the CNI library's skel package does (the same checks in the same
// order, the same error codes and messages), without skel's dependencies:
// its regexps, compiled at every exec, and its netns packages.

// CmdArgs is one invocation's input: the CNI_* variables and the stdin
// configuration.
type CmdArgs struct {
	// ContainerID is CNI_CONTAINERID.
	ContainerID string
	// Netns is CNI_NETNS.
	Netns string
	// IfName is CNI_IFNAME.
	IfName string
	// Args is CNI_ARGS.
	Args string
	// Path is CNI_PATH.
	Path string
	// NetnsOverride is CNI_NETNS_OVERRIDE: "1" or "true" skips the check
	// that CNI_NETNS is not the plugin's own network namespace.
	NetnsOverride string
	// StdinData is the configuration read from stdin.
	StdinData []byte
	// conf is StdinData decoded by the dispatcher, nil when it did not
	// decode as the plugin's configuration (the verb then says why).
	conf *rawConfig
}

// specVersion is the CNI spec version the VERSION answer is written in.
const specVersion = "1.1.0"

// cniEnv is one CNI_* variable and the commands that require it.
type cniEnv struct {
	name     string
	required []string // the commands that need it set
	validate func(string) *types.Error
}

// verbCommands are the commands that call a verb (VERSION is answered by
// the dispatcher).
var verbCommands = []string{"ADD", "CHECK", "DEL", "GC", "STATUS"}

// cniEnvs are skel's variables, in its order: the first invalid one wins,
// then every missing one is listed.
var cniEnvs = [...]cniEnv{
	{"CNI_COMMAND", verbCommands, nil},
	{"CNI_CONTAINERID", []string{"ADD", "CHECK", "DEL"}, validateContainerID},
	{"CNI_NETNS", []string{"ADD", "CHECK"}, nil},
	{"CNI_IFNAME", []string{"ADD", "CHECK", "DEL"}, validateIfName},
	{"CNI_ARGS", nil, nil},
	{"CNI_PATH", verbCommands, nil},
	{"CNI_NETNS_OVERRIDE", nil, nil},
}

// Run serves one CNI invocation: getenv reads the CNI_* variables, stdin
// the configuration. It writes the verb's result, or the error as CNI
// error JSON, to p.Stdout and returns the process's exit code.
func (p *Plugin) Run(getenv func(string) string, stdin io.Reader) int {
	vs := verbs{add: p.Add, del: p.Del, check: p.Check, gc: p.GC, status: p.Status}
	if e := dispatch(getenv, stdin, p.Stdout, p.Stderr, vs); e != nil {
		if err := writeError(p.Stdout, e); err != nil {
			_, _ = fmt.Fprintf(p.Stderr, "ambient-cni: writing the error JSON to stdout: %v\n", err)
		}
		return 1
	}
	return 0
}

// verbs are the functions dispatch calls, one per CNI command.
type verbs struct {
	add, del, check, gc, status func(*CmdArgs) error
}

func dispatch(getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer, vs verbs) *types.Error {
	cmd := getenv("CNI_COMMAND")
	if cmd == "" {
		// Run by hand: say what this is.
		_, _ = fmt.Fprintln(stderr, About)
		_, _ = fmt.Fprintf(stderr, "CNI protocol versions supported: %s\n", strings.Join(SupportedVersions, ", "))
		return nil
	}
	var vals [len(cniEnvs)]string
	var missing []string
	for i, v := range cniEnvs {
		vals[i] = getenv(v.name)
		req := slices.Contains(v.required, cmd)
		switch {
		case vals[i] == "" && req:
			missing = append(missing, v.name)
		case vals[i] != "" && req && v.validate != nil:
			if e := v.validate(vals[i]); e != nil {
				return e
			}
		}
	}
	if len(missing) > 0 {
		return types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("required env variables [%s] missing", strings.Join(missing, ",")), "")
	}
	if cmd == "VERSION" {
		// The spec gives VERSION a stdin; skel never reads it, nor do we.
		return writeVersion(stdout)
	}
	args := &CmdArgs{ContainerID: vals[1], Netns: vals[2], IfName: vals[3], Args: vals[4], Path: vals[5], NetnsOverride: vals[6]}
	data, err := readStdin(stdin)
	if err != nil {
		return err
	}
	args.StdinData = data
	// One decode serves the dispatcher and the verb; only a config that
	// does not decode as the plugin's is looked at again, as skel would,
	// for the error skel would give.
	var hdr *confHeader
	args.conf = new(rawConfig)
	if json.Unmarshal(data, args.conf) != nil {
		args.conf = nil
		if hdr, err = decodeHeader(data); err != nil {
			return err
		}
	} else if err := checkNetworkName(args.conf.Name); err != nil {
		return err
	}
	if !slices.Contains(verbCommands, cmd) {
		return types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("unknown CNI_COMMAND: %v", cmd), "")
	}
	v := "0.1.0" // the spec's first version had no cniVersion key
	if args.conf != nil && args.conf.CNIVersion != "" {
		v = args.conf.CNIVersion
	} else if hdr != nil {
		if v, err = hdr.version(); err != nil {
			return err
		}
	}
	switch cmd {
	case "ADD", "DEL":
		if err := checkVersion(v); err != nil {
			return err
		}
		// skel checks the namespace after the verb ran; checking first
		// keeps a rejected call from having told the agent anything.
		if err := checkNetns(args); err != nil {
			return err
		}
		if cmd == "ADD" {
			return asCNIError(vs.add(args))
		}
		return asCNIError(vs.del(args))
	case "CHECK":
		return gatedCall(cmd, v, "0.4.0", vs.check, args)
	case "GC":
		return gatedCall(cmd, v, "1.1.0", vs.gc, args)
	default: // STATUS
		return gatedCall(cmd, v, "1.1.0", vs.status, args)
	}
}

// readStdin reads the configuration, refusing more than maxConfigBytes:
// real ones are a few KiB, and a runtime gone wrong must not make the
// plugin buffer without bound.
func readStdin(r io.Reader) ([]byte, *types.Error) {
	data, err := io.ReadAll(io.LimitReader(r, maxConfigBytes+1))
	if err != nil {
		return nil, types.NewError(types.ErrIOFailure, fmt.Sprintf("error reading from stdin: %v", err), "")
	}
	if len(data) > maxConfigBytes {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("config on stdin is more than %d bytes", maxConfigBytes), "")
	}
	return data, nil
}

// confHeader is what the dispatcher needs from the configuration.
type confHeader struct {
	Name       json.RawMessage `json:"name"`
	CNIVersion json.RawMessage `json:"cniVersion"`
}

// decodeHeader checks the configuration is a JSON object with a valid
// network name.
func decodeHeader(data []byte) (*confHeader, *types.Error) {
	var h confHeader
	var name string
	err := json.Unmarshal(data, &h)
	if err == nil {
		err = unmarshalString(h.Name, &name)
	}
	if err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, fmt.Sprintf("error unmarshall network config: %v", err), "")
	}
	if err := checkNetworkName(name); err != nil {
		return nil, err
	}
	return &h, nil
}

// checkNetworkName refuses a missing or malformed network name.
func checkNetworkName(name string) *types.Error {
	if name == "" {
		return types.NewError(types.ErrInvalidNetworkConfig, "missing network name", "")
	}
	if !validName(name) {
		return types.NewError(types.ErrInvalidNetworkConfig, "invalid characters found in network name", name)
	}
	return nil
}

// version is the config's cniVersion, "0.1.0" when it names none (the
// spec's first version had no such key).
func (h *confHeader) version() (string, *types.Error) {
	var v string
	if err := unmarshalString(h.CNIVersion, &v); err != nil {
		return "", types.NewError(types.ErrDecodingFailure, fmt.Sprintf("decoding version from network config: %v", err), "")
	}
	if v == "" {
		v = "0.1.0"
	}
	return v, nil
}

// unmarshalString decodes a JSON string (absent or null leaves s empty).
func unmarshalString(raw json.RawMessage, s *string) error {
	if len(raw) == 0 {
		return nil
	}
	return json.Unmarshal(raw, s)
}

// checkVersion refuses a config version the plugin does not speak.
func checkVersion(v string) *types.Error {
	for _, s := range SupportedVersions {
		if v == s {
			return nil
		}
	}
	return types.NewError(types.ErrIncompatibleCNIVersion, "incompatible CNI versions", fmt.Sprintf("config is %q, plugin supports %q", v, SupportedVersions))
}

// gatedCall runs a verb that spec version minVersion introduced: the
// config must be at least that version and no newer than the newest the
// plugin speaks.
func gatedCall(cmd, v, minVersion string, verb func(*CmdArgs) error, args *CmdArgs) *types.Error {
	ok, err := versionAtLeast(v, minVersion)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	}
	if !ok {
		return types.NewError(types.ErrIncompatibleCNIVersion, "config version does not allow "+cmd, "")
	}
	if ok, err := versionAtLeast(SupportedVersions[len(SupportedVersions)-1], v); err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	} else if !ok {
		return types.NewError(types.ErrIncompatibleCNIVersion, "plugin version does not allow "+cmd, "")
	}
	if err := checkVersion(v); err != nil {
		return err
	}
	return asCNIError(verb(args))
}

// versionAtLeast reports a >= b, as CNI compares versions: up to three
// dot-separated integers, missing parts zero.
func versionAtLeast(a, b string) (bool, error) {
	x, err := parseVersion(a)
	if err != nil {
		return false, err
	}
	y, err := parseVersion(b)
	if err != nil {
		return false, err
	}
	for i := range x {
		if x[i] != y[i] {
			return x[i] > y[i], nil
		}
	}
	return true, nil
}

func parseVersion(v string) ([3]int, error) {
	if v == "" {
		return [3]int{0, 1, 0}, nil
	}
	parts := strings.Split(v, ".")
	if len(parts) >= 4 {
		return [3]int{}, fmt.Errorf("invalid version %q: too many parts", v)
	}
	var out [3]int
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil {
			return [3]int{}, fmt.Errorf("failed to convert %s version part %q: %w", [...]string{"major", "minor", "micro"}[i], p, err)
		}
		out[i] = n
	}
	return out, nil
}

// checkNetns refuses a CNI_NETNS that is the plugin's own network
// namespace, unless CNI_NETNS_OVERRIDE says to skip the check. A path that
// cannot be read is left for the verb to judge (DEL of a gone sandbox has
// none). stat never opens the path, so a FIFO or device there cannot block
// or act.
func checkNetns(args *CmdArgs) *types.Error {
	if o := args.NetnsOverride; o == "1" || strings.EqualFold(o, "true") || args.Netns == "" {
		return nil
	}
	var target, self syscall.Stat_t
	if syscall.Stat(args.Netns, &target) != nil {
		return nil
	}
	if err := syscall.Stat("/proc/thread-self/ns/net", &self); err != nil {
		return types.NewError(types.ErrInvalidNetNS, "get plugin's netns failed", "")
	}
	if target.Dev == self.Dev && target.Ino == self.Ino {
		return types.NewError(types.ErrInvalidNetNS, "plugin's netns and netns from CNI_NETNS should not be the same", "")
	}
	return nil
}

// asCNIError keeps a verb's *types.Error and makes any other error an
// internal one (code 999).
func asCNIError(err error) *types.Error {
	if err == nil {
		return nil
	}
	var e *types.Error
	if errors.As(err, &e) {
		return e
	}
	return types.NewError(types.ErrInternal, err.Error(), "")
}

// writeError prints e as the spec's error JSON, indented as skel does.
func writeError(w io.Writer, e *types.Error) error {
	b, err := json.MarshalIndent(e, "", "    ")
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// writeVersion prints the VERSION answer.
func writeVersion(w io.Writer) *types.Error {
	err := json.NewEncoder(w).Encode(struct {
		CNIVersion        string   `json:"cniVersion"`
		SupportedVersions []string `json:"supportedVersions"`
	}{specVersion, SupportedVersions})
	if err != nil {
		return types.NewError(types.ErrIOFailure, err.Error(), "")
	}
	return nil
}

// validName is CNI's rule for container ids and network names,
// ^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$, without a regexp.
func validName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '_' && c != '.' && c != '-') {
			return false
		}
	}
	return s != ""
}

func validateContainerID(id string) *types.Error {
	if !validName(id) {
		return types.NewError(types.ErrInvalidEnvironmentVariables, "invalid characters in containerID", id)
	}
	return nil
}

// maxIfNameLen is the kernel's IFNAMSIZ less the terminating NUL.
const maxIfNameLen = 15

func validateIfName(name string) *types.Error {
	switch {
	case len(name) > maxIfNameLen:
		return types.NewError(types.ErrInvalidEnvironmentVariables, "interface name is too long", fmt.Sprintf("interface name should be less than %d characters", maxIfNameLen+1))
	case name == "." || name == "..":
		return types.NewError(types.ErrInvalidEnvironmentVariables, "interface name is . or ..", "")
	}
	for _, r := range name {
		if r == '/' || r == ':' || unicode.IsSpace(r) {
			return types.NewError(types.ErrInvalidEnvironmentVariables, "interface name contains / or : or whitespace characters", "")
		}
	}
	return nil
}
