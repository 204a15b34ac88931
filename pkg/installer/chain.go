package installer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/version"
)

// MaxConfigSize bounds the CNI config files the installer reads and edits.
// Real primary configs are a few KiB; anything this large is hostile or
// broken, and refusing it keeps a bad file from costing memory.
const MaxConfigSize = 1 << 20

// MinChainVersion is the oldest cniVersion that supports chained plugins
// (prevResult appeared in spec 0.3.0).
const MinChainVersion = "0.3.0"

// Errors returned by ChainInto and Unchain. They wrap the detailed cause.
var (
	// ErrInvalidConfig means the file is not a CNI config the runtime would load.
	ErrInvalidConfig = errors.New("invalid CNI config")
	// ErrConfigTooLarge means the file exceeds MaxConfigSize.
	ErrConfigTooLarge = errors.New("CNI config too large")
	// ErrNoPrimaryPlugin means the file holds only our own plugin, so there
	// is no primary CNI to chain after.
	ErrNoPrimaryPlugin = errors.New("CNI config has no primary plugin besides ours")
	// ErrUnsupportedVersion means the config's cniVersion predates chaining.
	ErrUnsupportedVersion = errors.New("CNI config version does not support chaining")
	// ErrInvalidEntry means the caller-supplied plugin entry is unusable.
	ErrInvalidEntry = errors.New("invalid plugin entry")
	// ErrIstioCNIChained means Istio's own CNI plugin is already in the
	// chain: two agents would both redirect the pod's traffic.
	ErrIstioCNIChained = errors.New("istio-cni is already chained in the primary CNI config")
)

// IstioCNIType is the plugin type istio-cni chains into the primary config.
const IstioCNIType = "istio-cni"

// ConflistExt is the extension of a chained configuration list.
const ConflistExt = ".conflist"

// listInfo is what the chaining code needs to know about a .conflist.
type listInfo struct {
	plugins arrayLayout
	ours    []bool // ours[i]: plugins.elems[i] has our type
	nOurs   int
	// nIstio counts istio-cni entries (when that is not our own type).
	nIstio int
}

// ChainInto returns conf with entry as the last plugin of its chain.
//
// fileName decides the format the way the runtime does: a ".conflist" is a
// configuration list; a ".conf" or ".json" file is a single plugin config,
// which is converted into a list (same name and cniVersion, the original
// object as the first plugin) and newFileName is then the ".conflist" name.
// Entries of pluginType already present anywhere in the list are removed
// first, so the result holds exactly one, last. Every byte that is not part
// of one of our entries is kept as it was: nothing is re-encoded, the entry
// is spliced in, formatted to match the surrounding indentation.
//
// entry must be a JSON object; when it has no "type", one naming pluginType
// is added. ChainInto is a pure function.
func ChainInto(conf []byte, fileName string, entry json.RawMessage, pluginType string) (out []byte, newFileName string, err error) {
	if pluginType == "" {
		return nil, "", fmt.Errorf("%w: empty plugin type", ErrInvalidEntry)
	}
	if len(conf) > MaxConfigSize {
		return nil, "", fmt.Errorf("%w: %d bytes (limit %d)", ErrConfigTooLarge, len(conf), MaxConfigSize)
	}
	ent, err := normalizeEntry(entry, pluginType)
	if err != nil {
		return nil, "", err
	}
	switch ext := filepath.Ext(fileName); ext {
	case ConflistExt:
		out, err = chainList(conf, ent, pluginType)
		return out, fileName, err
	case ".conf", ".json":
		list, err := convertConf(conf, pluginType)
		if err != nil {
			return nil, "", err
		}
		out, err = chainList(list, ent, pluginType)
		return out, strings.TrimSuffix(fileName, ext) + ConflistExt, err
	default:
		return nil, "", fmt.Errorf("%w: %q is not a .conf, .conflist or .json file", ErrInvalidConfig, fileName)
	}
}

// Unchain returns conf, a configuration list, without any plugin of
// pluginType. Only the bytes of those entries and one adjacent separator
// each go; everything else is kept byte for byte, so Unchain undoes
// ChainInto exactly for a list that held no entry of ours before. A list
// without our entry is returned unchanged.
func Unchain(conf []byte, pluginType string) ([]byte, error) {
	if len(conf) > MaxConfigSize {
		return nil, fmt.Errorf("%w: %d bytes (limit %d)", ErrConfigTooLarge, len(conf), MaxConfigSize)
	}
	info, err := inspectList(conf, pluginType)
	if err != nil {
		return nil, err
	}
	if info.nOurs == 0 {
		return bytes.Clone(conf), nil
	}
	if info.nOurs == len(info.ours) {
		return nil, ErrNoPrimaryPlugin
	}
	return removeElems(conf, info.plugins, info.ours), nil
}

// chainList removes our entries from a list and appends ent.
func chainList(conf, ent []byte, pluginType string) ([]byte, error) {
	info, err := inspectList(conf, pluginType)
	if err != nil {
		return nil, err
	}
	if info.nOurs == len(info.ours) {
		return nil, ErrNoPrimaryPlugin
	}
	if info.nIstio > 0 {
		return nil, istioCNIError()
	}
	if info.nOurs > 0 {
		conf = removeElems(conf, info.plugins, info.ours)
		if info, err = inspectList(conf, pluginType); err != nil {
			return nil, fmt.Errorf("after removing stale entries: %w", err)
		}
	}
	out := appendElem(conf, info.plugins, ent)
	// The splice is simple enough to trust, but a broken config stops every
	// pod on the node, so prove the result loads and ends with us.
	check, err := inspectList(out, pluginType)
	if err != nil {
		return nil, fmt.Errorf("chained config does not load: %w", err)
	}
	if check.nOurs != 1 || !check.ours[len(check.ours)-1] {
		return nil, fmt.Errorf("chained config does not end with exactly one %q entry", pluginType)
	}
	return out, nil
}

// inspectList validates conf as the runtime would load a .conflist and
// locates its plugins array.
func inspectList(conf []byte, pluginType string) (listInfo, error) {
	if !json.Valid(conf) {
		return listInfo{}, fmt.Errorf("%w: malformed JSON: %v", ErrInvalidConfig, syntaxError(conf))
	}
	top := topValue(conf)
	if conf[top.start] != '{' {
		return listInfo{}, fmt.Errorf("%w: top level is %s, want an object", ErrInvalidConfig, kindOf(conf[top.start]))
	}
	list, err := libcni.NetworkConfFromBytes(conf)
	if err != nil {
		return listInfo{}, fmt.Errorf("%w: %v", ErrInvalidConfig, err)
	}
	if err := checkVersion(list.CNIVersion); err != nil {
		return listInfo{}, err
	}
	members, err := objectMembers(conf, top.start)
	if err != nil {
		return listInfo{}, fmt.Errorf("%w: %v", ErrInvalidConfig, err)
	}
	var pluginsAt []span
	for _, m := range members {
		// Exact match: libcni reads the list into a map, so "Plugins" is
		// not the plugins array to it either.
		if m.key == "plugins" {
			pluginsAt = append(pluginsAt, m.value)
		}
	}
	switch len(pluginsAt) {
	case 0:
		return listInfo{}, fmt.Errorf("%w: no inline \"plugins\" array (plugins loaded from a directory are not supported)", ErrInvalidConfig)
	case 1:
	default:
		return listInfo{}, fmt.Errorf("%w: %d \"plugins\" keys; refusing to edit an ambiguous file", ErrInvalidConfig, len(pluginsAt))
	}
	layout, err := arrayElems(conf, pluginsAt[0].start)
	if err != nil {
		return listInfo{}, fmt.Errorf("%w: plugins: %v", ErrInvalidConfig, err)
	}
	info := listInfo{plugins: layout, ours: make([]bool, len(layout.elems))}
	for i, e := range layout.elems {
		t, err := pluginTypeOf(conf[e.start:e.end])
		if err != nil {
			return listInfo{}, fmt.Errorf("%w: plugin %d: %v", ErrInvalidConfig, i, err)
		}
		if t == pluginType {
			info.ours[i] = true
			info.nOurs++
		} else if t == IstioCNIType {
			info.nIstio++
		}
	}
	return info, nil
}

// pluginTypeOf decodes a plugin object's type with the same rules libcni
// uses (encoding/json into a struct), so "ours" means what the runtime sees.
func pluginTypeOf(obj []byte) (string, error) {
	var p struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(obj, &p); err != nil {
		return "", err
	}
	if p.Type == "" {
		return "", errors.New("missing 'type'")
	}
	return p.Type, nil
}

func checkVersion(v string) error {
	if v == "" {
		return fmt.Errorf("%w: no cniVersion (chaining needs %s or later)", ErrUnsupportedVersion, MinChainVersion)
	}
	ok, err := version.GreaterThanOrEqualTo(v, MinChainVersion)
	if err != nil {
		return fmt.Errorf("%w: cniVersion %q: %v", ErrInvalidConfig, v, err)
	}
	if !ok {
		return fmt.Errorf("%w: cniVersion %q (chaining needs %s or later)", ErrUnsupportedVersion, v, MinChainVersion)
	}
	return nil
}

// convertConf turns a single-plugin config into a one-plugin list the way
// libcni does (the original object, untouched in content, becomes the first
// plugin; name and cniVersion are lifted to the list).
func convertConf(conf []byte, pluginType string) ([]byte, error) {
	if !json.Valid(conf) {
		return nil, fmt.Errorf("%w: malformed JSON: %v", ErrInvalidConfig, syntaxError(conf))
	}
	top := topValue(conf)
	if conf[top.start] != '{' {
		return nil, fmt.Errorf("%w: top level is %s, want an object", ErrInvalidConfig, kindOf(conf[top.start]))
	}
	pc, err := libcni.NetworkPluginConfFromBytes(conf)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidConfig, err)
	}
	if pc.Network.Type == pluginType {
		return nil, ErrNoPrimaryPlugin
	}
	if err := checkVersion(pc.Network.CNIVersion); err != nil {
		return nil, err
	}
	ver, _ := json.Marshal(pc.Network.CNIVersion)
	name, _ := json.Marshal(pc.Network.Name)
	var orig bytes.Buffer
	if err := json.Indent(&orig, compact(conf[top.start:top.end]), "    ", "  "); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidConfig, err)
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "{\n  \"cniVersion\": %s,\n  \"name\": %s,\n  \"plugins\": [\n    %s\n  ]\n}\n", ver, name, orig.Bytes())
	return b.Bytes(), nil
}

// normalizeEntry checks the caller's entry and returns it compacted, with a
// "type" member naming pluginType.
func normalizeEntry(entry json.RawMessage, pluginType string) ([]byte, error) {
	e := bytes.TrimSpace(entry)
	if len(e) == 0 {
		e = []byte("{}")
	}
	if !json.Valid(e) {
		return nil, fmt.Errorf("%w: malformed JSON: %v", ErrInvalidEntry, syntaxError(e))
	}
	if e[0] != '{' {
		return nil, fmt.Errorf("%w: entry is %s, want an object", ErrInvalidEntry, kindOf(e[0]))
	}
	e = compact(e)
	if t, _ := pluginTypeOf(e); t == "" {
		typ, _ := json.Marshal(pluginType)
		rest := bytes.TrimSpace(e[1:])
		sep := ","
		if rest[0] == '}' {
			sep = ""
		}
		e = append(append([]byte(`{"type":`), typ...), append([]byte(sep), rest...)...)
	}
	if t, err := pluginTypeOf(e); err != nil || t != pluginType {
		return nil, fmt.Errorf("%w: entry type is %q, want %q", ErrInvalidEntry, t, pluginType)
	}
	return e, nil
}

// removeElems deletes the marked elements of an array together with one
// separator each, working from the end so earlier offsets stay valid.
func removeElems(b []byte, l arrayLayout, drop []bool) []byte {
	out := bytes.Clone(b)
	laterKept := false
	for i := len(l.elems) - 1; i >= 0; i-- {
		if !drop[i] {
			laterKept = true
			continue
		}
		var from, to int
		switch {
		case laterKept: // take the element and the separator after it
			from, to = l.elems[i].start, l.elems[i+1].start
		case i > 0: // last remaining: take the separator before it
			from, to = l.elems[i-1].end, l.elems[i].end
		default:
			from, to = l.elems[i].start, l.elems[i].end
		}
		out = append(out[:from], out[to:]...)
	}
	return out
}

// appendElem inserts ent after the last element of a non-empty array,
// copying the array's own separator and indentation so the result reads as
// if one tool had written it, and so that removing the last element again
// (removeElems) gives back exactly b.
func appendElem(b []byte, l arrayLayout, ent []byte) []byte {
	n := len(l.elems)
	last := l.elems[n-1]
	lead := string(b[l.open+1 : l.elems[0].start])
	var sep string
	if n >= 2 {
		sep = string(b[l.elems[n-2].end:l.elems[n-1].start])
	} else {
		sep = "," + lead
	}
	formatted := ent
	if nl := strings.LastIndexByte(sep, '\n'); nl >= 0 {
		indent := sep[nl+1:]
		closeIndent := lineIndent(b, l.close)
		unit := "  "
		if len(indent) > len(closeIndent) && strings.HasPrefix(indent, closeIndent) {
			unit = indent[len(closeIndent):]
		}
		var buf bytes.Buffer
		if err := json.Indent(&buf, ent, indent, unit); err == nil {
			formatted = buf.Bytes()
			if strings.Contains(sep, "\r\n") {
				// Match a CRLF file; JSON strings hold no raw newlines,
				// so every '\n' here is formatting.
				formatted = bytes.ReplaceAll(formatted, []byte("\n"), []byte("\r\n"))
			}
		}
	}
	out := make([]byte, 0, len(b)+len(sep)+len(formatted))
	out = append(out, b[:last.end]...)
	out = append(out, sep...)
	out = append(out, formatted...)
	return append(out, b[last.end:]...)
}

// lineIndent returns the whitespace that precedes b[i] on its line, or ""
// when something other than whitespace does.
func lineIndent(b []byte, i int) string {
	j := i
	for j > 0 && (b[j-1] == ' ' || b[j-1] == '\t') {
		j--
	}
	if j == 0 || b[j-1] == '\n' || b[j-1] == '\r' {
		return string(b[j:i])
	}
	return ""
}

func compact(b []byte) []byte {
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return b
	}
	return buf.Bytes()
}

// syntaxError reports where a document stops being JSON.
func syntaxError(b []byte) error {
	var v any
	err := json.Unmarshal(b, &v)
	if err == nil {
		return errors.New("not valid JSON")
	}
	return err
}

// istioCNIError says what to do about a chained istio-cni: it and
// ambient-cni each redirect a pod's traffic, so only one may run on a node.
func istioCNIError() error {
	return fmt.Errorf("%w: not chaining next to it; uninstall istio-cni (helm uninstall its release, or remove its DaemonSet and its %q entry from the config) or remove ambient-cni", ErrIstioCNIChained, IstioCNIType)
}
