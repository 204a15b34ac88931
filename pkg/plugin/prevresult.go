package plugin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/types/create"
)

// PrevResult is the previous plugin's result, read once when the config is
// parsed: what the plugin prints and the pod's addresses in it.
type PrevResult struct {
	// out is the result in the config's version, as the plugin prints it.
	out    []byte
	ips    []string
	ipsErr error
}

// PodIPs lists the addresses the result gave the pod's own interfaces.
func (r *PrevResult) PodIPs() ([]string, error) { return r.ips, r.ipsErr }

// resultVersions are the CNI versions whose results the CNI library reads.
var resultVersions = []string{"0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// ipsResultVersions are those whose results list "ips" with an
// "interface" index and an "address" CIDR (before 0.3.0 they had
// "ip4"/"ip6").
var ipsResultVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// parsePrevResult reads the previous plugin's result by its own cniVersion
// (the config's when it names none), so a primary plugin that answers in
// another supported version than the conflist's is no reason to keep a pod
// from starting, and converts it now to the config's version, in which the
// plugin prints it. A result in the config's version already (the usual
// case) is printed as it came, and only the fields the plugin reads are
// decoded: the runtime parses the chain's final result itself.
func parsePrevResult(raw json.RawMessage, confVersion string) (*PrevResult, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var lite liteResult
	if err := json.Unmarshal(raw, &lite); err != nil {
		if v, verr := resultVersion(raw); verr != nil || v != confVersion || !slices.Contains(ipsResultVersions, v) {
			// Not the fast path's shape: let the library say what is wrong.
			return convertPrevResult(raw, confVersion)
		}
		return nil, types.NewError(types.ErrDecodingFailure, "decode prevResult: "+err.Error(), "")
	}
	v, err := lite.version()
	if err != nil {
		return nil, err
	}
	if v != confVersion || !slices.Contains(ipsResultVersions, v) {
		return convertPrevResult(raw, confVersion)
	}
	ips, err := lite.podIPs()
	if err != nil {
		return nil, err
	}
	return &PrevResult{out: raw, ips: ips}, nil
}

// liteResult is what the plugin reads of an "ips"-style result.
type liteResult struct {
	CNIVersion json.RawMessage `json:"cniVersion"`
	Interfaces []struct {
		Sandbox string `json:"sandbox"`
	} `json:"interfaces"`
	IPs []struct {
		Interface *int   `json:"interface"`
		Address   string `json:"address"`
	} `json:"ips"`
}

// version is the result's cniVersion, "" when it names none.
func (r *liteResult) version() (string, error) {
	var v string
	if len(r.CNIVersion) > 0 && string(r.CNIVersion) != "null" {
		if err := json.Unmarshal(r.CNIVersion, &v); err != nil {
			return "", types.NewError(types.ErrDecodingFailure, fmt.Sprintf("decode prevResult: cniVersion %s is not a string", r.CNIVersion), "")
		}
	}
	return v, nil
}

// resultVersion reads only a result's cniVersion.
func resultVersion(raw []byte) (string, error) {
	var r struct {
		CNIVersion json.RawMessage `json:"cniVersion"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return "", types.NewError(types.ErrDecodingFailure, "decode prevResult: "+err.Error(), "")
	}
	l := liteResult{CNIVersion: r.CNIVersion}
	return l.version()
}

func (r *liteResult) podIPs() ([]string, error) {
	var out []string
	for _, ip := range r.IPs {
		if ip.Interface != nil {
			i := *ip.Interface
			if i < 0 || i >= len(r.Interfaces) || r.Interfaces[i].Sandbox == "" {
				continue // an address on a host-side interface
			}
		}
		if ip.Address == "" {
			continue
		}
		p, err := netip.ParsePrefix(ip.Address)
		if err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "decode prevResult: "+err.Error(), "")
		}
		if s := p.Addr().Unmap().String(); !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out, nil
}

// convertPrevResult reads a result with the CNI library and converts it
// to the config's version.
func convertPrevResult(raw []byte, confVersion string) (*PrevResult, error) {
	v, err := resultVersion(raw)
	if err != nil {
		return nil, err
	}
	switch {
	case v == "":
		// Results before 1.0.0 need not name their version: it is the
		// config's. The library reads the version from the result.
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "decode prevResult: "+err.Error(), "")
		}
		m["cniVersion"] = confVersion
		if raw, err = json.Marshal(m); err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "decode prevResult: "+err.Error(), "")
		}
	case !slices.Contains(resultVersions, v):
		return nil, types.NewError(types.ErrIncompatibleCNIVersion, fmt.Sprintf("prevResult has cniVersion %q, which no CNI spec defines a result for", v),
			"known: "+strings.Join(resultVersions, ", "))
	}
	res, err := create.CreateFromBytes(raw)
	if err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "decode prevResult: "+err.Error(), "")
	}
	conv, err := res.GetAsVersion(confVersion)
	if err != nil {
		return nil, types.NewError(types.ErrIncompatibleCNIVersion,
			fmt.Sprintf("prevResult in CNI version %s cannot be converted to the config's %s: %v", res.Version(), confVersion, err), "")
	}
	var out bytes.Buffer
	if err := conv.PrintTo(&out); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "encode prevResult: "+err.Error(), "")
	}
	r := &PrevResult{out: out.Bytes()}
	r.ips, r.ipsErr = podIPs(res)
	return r, nil
}

func podIPs(prev types.Result) ([]string, error) {
	res, err := current.NewResultFromResult(prev)
	if err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "read prevResult: "+err.Error(), "")
	}
	var out []string
	for _, ip := range res.IPs {
		if ip.Interface != nil {
			i := *ip.Interface
			if i < 0 || i >= len(res.Interfaces) || res.Interfaces[i].Sandbox == "" {
				continue // an address on a host-side interface
			}
		}
		a, ok := netip.AddrFromSlice(ip.Address.IP)
		if !ok {
			continue
		}
		s := a.Unmap().String()
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out, nil
}
