package ztunnel

import (
	"fmt"
	"net/netip"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
	"google.golang.org/protobuf/proto"
)

// readBufferSize is what ztunnel reads each datagram with; a larger
// message is truncated, which is a protocol error.
const readBufferSize = 1024

// verdict is what ztunnel does with one request before acting on it.
type verdict int

const (
	accept   verdict = iota // act on it and ack
	reject                  // ack with an error, keep the connection
	teardown                // protocol error: ack with an error and hang up
)

// judge decodes one request and applies the spec's rules: an Add carries
// exactly one descriptor and workload_info, other requests carry none, Keep
// and SnapshotSent are only valid during the snapshot. It is pure so that
// fuzzing can drive it.
func judge(b []byte, nfds int, snapshotDone bool) (*zdspb.WorkloadRequest, verdict, string) {
	if len(b) == 0 || len(b) >= readBufferSize {
		return nil, teardown, fmt.Sprintf("message of %d bytes", len(b))
	}
	var req zdspb.WorkloadRequest
	if err := proto.Unmarshal(b, &req); err != nil {
		return nil, teardown, fmt.Sprintf("undecodable request: %v", err)
	}
	switch p := req.Payload.(type) {
	case *zdspb.WorkloadRequest_Add:
		if p.Add.GetWorkloadInfo() == nil {
			return &req, teardown, "add without workload_info"
		}
		if nfds != 1 {
			return &req, reject, fmt.Sprintf("add needs exactly one fd, got %d", nfds)
		}
		if p.Add.GetUid() == "" {
			return &req, reject, "add without uid"
		}
	case *zdspb.WorkloadRequest_Keep:
		if snapshotDone {
			return &req, teardown, "keep after snapshot"
		}
		if nfds != 0 {
			return &req, reject, fmt.Sprintf("keep must carry no fd, got %d", nfds)
		}
	case *zdspb.WorkloadRequest_Del:
		if nfds != 0 {
			return &req, reject, fmt.Sprintf("del must carry no fd, got %d", nfds)
		}
	case *zdspb.WorkloadRequest_SnapshotSent:
		if snapshotDone {
			return &req, teardown, "second snapshot_sent"
		}
		if nfds != 0 {
			return &req, reject, fmt.Sprintf("snapshot_sent must carry no fd, got %d", nfds)
		}
	default:
		return &req, teardown, "request without a known payload"
	}
	return &req, accept, ""
}

// parseConnectLine parses the stand-in's tunnel header, "CONNECT ip:port\n",
// as sent from a pod's 15001 to the destination pod's 15008.
func parseConnectLine(line []byte) (netip.AddrPort, error) {
	const prefix = "CONNECT "
	if len(line) > maxConnectLine {
		return netip.AddrPort{}, fmt.Errorf("connect header longer than %d bytes", maxConnectLine)
	}
	s := string(line)
	if len(s) == 0 || s[len(s)-1] != '\n' {
		return netip.AddrPort{}, fmt.Errorf("connect header not terminated")
	}
	s = s[:len(s)-1]
	if len(s) <= len(prefix) || s[:len(prefix)] != prefix {
		return netip.AddrPort{}, fmt.Errorf("not a connect header: %q", s)
	}
	ap, err := netip.ParseAddrPort(s[len(prefix):])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("connect header: %w", err)
	}
	if ap.Port() == 0 || !ap.Addr().IsValid() || ap.Addr().Zone() != "" {
		return netip.AddrPort{}, fmt.Errorf("connect header: bad target %s", ap)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// connectLine renders the tunnel header for target.
func connectLine(target netip.AddrPort) []byte {
	return []byte("CONNECT " + target.String() + "\n")
}

// maxConnectLine bounds the tunnel header.
const maxConnectLine = 128
