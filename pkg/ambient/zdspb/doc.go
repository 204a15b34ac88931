// Package zdspb holds the ZDS protobuf messages (protobuf package
// istio.workload.zds), the agent↔ztunnel part of the contract, used by the
// agent's ZDS server (pkg/zds) and the ztunnel stand-in (test/lib/ztunnel);
// generated from zds.proto by `make generate`. The
// generated code is committed so builds need neither protoc nor the plugin.
package zdspb
