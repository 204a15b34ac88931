package kubectlplugin

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"sigs.k8s.io/yaml"
)

// maxValuesBytes bounds the values file preflight reads: Istio's whole
// values.yaml with every profile is far below it.
const maxValuesBytes = 1 << 20

// IstioValues are the keys of an istio-cni values file the switch's plan
// depends on, read as Istio's chart reads them: cni.* over the top level.
// The chart (helm template) validates the whole file.
type IstioValues struct {
	// OwnedConfig is istioOwnedCNIConfig: istio-cni writes a conflist of
	// its own (OwnedConfName) instead of chaining into the primary's.
	OwnedConfig   bool
	OwnedConfName string
	// Chained false or Provider multus: istio-cni runs as a Multus
	// network, not chained.
	Chained  *bool
	Provider string
	// AmbientEnabled false: istio-cni for sidecars only.
	AmbientEnabled *bool
	// DetectionRetry is ambient.enableAmbientDetectionRetry.
	DetectionRetry *bool
}

// ReadIstioValues reads an istio-cni values file, refusing what is not a
// YAML map of at most maxValuesBytes, and the keys the plan reads when
// they have the wrong type.
func ReadIstioValues(path string) (IstioValues, error) {
	var v IstioValues
	f, err := os.Open(path)
	if err != nil {
		return v, fmt.Errorf("values file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return v, fmt.Errorf("values file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return v, fmt.Errorf("values file %s: not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxValuesBytes+1))
	if err != nil {
		return v, fmt.Errorf("values file %s: %w", path, err)
	}
	if len(b) > maxValuesBytes {
		return v, fmt.Errorf("values file %s: larger than %d bytes", path, maxValuesBytes)
	}
	return ParseIstioValues(b)
}

// ParseIstioValues is ReadIstioValues on the file's bytes.
func ParseIstioValues(b []byte) (IstioValues, error) {
	var v IstioValues
	var top any
	if err := yaml.Unmarshal(b, &top); err != nil {
		return v, fmt.Errorf("values: not YAML: %w", err)
	}
	if top == nil {
		return v, nil
	}
	m, ok := top.(map[string]any)
	if !ok {
		return v, fmt.Errorf("values: the file is a %T, want a map of values", top)
	}
	// Istio's chart copies cni.* over the top level: cni's keys win.
	merged := map[string]any{}
	for k, x := range m {
		merged[k] = x
	}
	if cni, ok := m["cni"]; ok && cni != nil {
		cm, ok := cni.(map[string]any)
		if !ok {
			return v, fmt.Errorf("values: cni is a %T, want a map", cni)
		}
		for k, x := range cm {
			merged[k] = x
		}
	}
	var errs []error
	boolAt := func(path ...string) *bool {
		x, ok := lookup(merged, path...)
		if !ok || x == nil {
			return nil
		}
		b, ok := x.(bool)
		if !ok {
			errs = append(errs, fmt.Errorf("values: %s is %v, want true or false", strings.Join(path, "."), x))
			return nil
		}
		return &b
	}
	stringAt := func(path ...string) string {
		x, ok := lookup(merged, path...)
		if !ok || x == nil {
			return ""
		}
		s, ok := x.(string)
		if !ok {
			errs = append(errs, fmt.Errorf("values: %s is %v, want a string", strings.Join(path, "."), x))
		}
		return s
	}
	if b := boolAt("istioOwnedCNIConfig"); b != nil {
		v.OwnedConfig = *b
	}
	v.OwnedConfName = stringAt("istioOwnedCNIConfigFileName")
	v.Chained = boolAt("chained")
	v.Provider = stringAt("provider")
	v.AmbientEnabled = boolAt("ambient", "enabled")
	v.DetectionRetry = boolAt("ambient", "enableAmbientDetectionRetry")
	return v, errors.Join(errs...)
}

// lookup follows path through nested maps.
func lookup(m map[string]any, path ...string) (any, bool) {
	var cur any = m
	for _, k := range path {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = mm[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}
