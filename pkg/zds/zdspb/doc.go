// Package zdspb holds the ZDS protobuf messages (protobuf package
// istio.workload.zds) generated from zds.proto by `make generate`. The
// generated code is committed so builds need neither protoc nor the plugin.
package zdspb
