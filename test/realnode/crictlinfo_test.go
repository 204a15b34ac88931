//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
)

// runtimeInfo is the part of containerd's CRI status (crictl info) the
// tests read: a crictl info is a CRI Status call made now (containerd 2.x
// calls each plugin's CNI STATUS for it).
type runtimeInfo struct {
	Status struct {
		Conditions []struct {
			Type    string `json:"type"`
			Status  bool   `json:"status"`
			Reason  string `json:"reason"`
			Message string `json:"message"`
		} `json:"conditions"`
	} `json:"status"`
	RuntimeHandlers []struct {
		Features map[string]any `json:"features"`
	} `json:"runtimeHandlers"`
	// CNIConfig is the CNI config containerd has loaded, the one its next
	// ADD runs: an object, or that object as a JSON string.
	CNIConfig         json.RawMessage `json:"cniconfig"`
	LastCNILoadStatus string          `json:"lastCNILoadStatus"`
}

// runtimeInfo asks containerd for its CRI status.
func (e *e2e) runtimeInfo(ctx context.Context) (runtimeInfo, error) {
	var info runtimeInfo
	out, err := e.n.crictl(ctx, "info")
	if err != nil {
		return info, err
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		return info, fmt.Errorf("crictl info: %w", err)
	}
	return info, nil
}
