package zds

import (
	"errors"
	"fmt"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
	"google.golang.org/protobuf/proto"
)

// MaxMessageSize is the largest datagram either side may send: ztunnel
// reads with a 1024-byte buffer, so every message must be smaller than that.
const MaxMessageSize = 1023

// ErrMessageTooLarge means an encoded message would not fit in ztunnel's
// read buffer; the request is refused before anything is sent.
var ErrMessageTooLarge = errors.New("zds message too large")

// errProtocol marks a peer message that breaks the protocol; the
// connection it arrived on is torn down.
var errProtocol = errors.New("zds protocol violation")

// encodeRequest marshals a request and enforces the size limit.
func encodeRequest(req *zdspb.WorkloadRequest) ([]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("marshal zds request: %w", err)
	}
	if len(b) > MaxMessageSize {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrMessageTooLarge, len(b), MaxMessageSize)
	}
	return b, nil
}

// addRequest builds the Add for a workload.
func addRequest(uid string, info WorkloadInfo) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid: uid,
		WorkloadInfo: &zdspb.WorkloadInfo{
			Name:           info.Name,
			Namespace:      info.Namespace,
			ServiceAccount: info.ServiceAccount,
		},
	}}}
}

func keepRequest(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
}

func delRequest(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
}

func snapshotSentRequest() *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}
}

// decodeHello parses ztunnel's first message. An empty or unversioned
// hello is refused: it is what garbage most often decodes to.
func decodeHello(b []byte) (*zdspb.ZdsHello, error) {
	if len(b) == 0 || len(b) > MaxMessageSize {
		return nil, fmt.Errorf("%w: hello of %d bytes", errProtocol, len(b))
	}
	var h zdspb.ZdsHello
	if err := proto.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("%w: decode hello: %w", errProtocol, err)
	}
	if h.GetVersion() < zdspb.Version_V1 {
		return nil, fmt.Errorf("%w: hello with version %d", errProtocol, h.GetVersion())
	}
	return &h, nil
}

// decodeAck parses a response and returns its Ack; a response without one
// is a protocol violation.
func decodeAck(b []byte) (*zdspb.Ack, error) {
	if len(b) == 0 || len(b) > MaxMessageSize {
		return nil, fmt.Errorf("%w: response of %d bytes", errProtocol, len(b))
	}
	var r zdspb.WorkloadResponse
	if err := proto.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%w: decode response: %w", errProtocol, err)
	}
	ack := r.GetAck()
	if ack == nil {
		return nil, fmt.Errorf("%w: response without ack", errProtocol)
	}
	return ack, nil
}
