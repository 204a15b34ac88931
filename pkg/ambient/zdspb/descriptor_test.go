package zdspb

import (
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// TestDescriptorMatchesSpec reads the compiled descriptor and checks every
// name, field number, kind and oneof membership the compatibility spec
// fixes, so an edit of zds.proto cannot silently break real ztunnel.
func TestDescriptorMatchesSpec(t *testing.T) {
	fd := File_zds_proto
	if fd.Package() != "istio.workload.zds" {
		t.Fatalf("package %q", fd.Package())
	}
	if fd.Syntax() != protoreflect.Proto3 {
		t.Fatalf("syntax %v, want proto3", fd.Syntax())
	}
	type field struct {
		num   protoreflect.FieldNumber
		kind  protoreflect.Kind
		msg   string // message type for MessageKind, enum type for EnumKind
		oneof string
	}
	want := map[string]map[string]field{
		"ZdsHello":     {"version": {1, protoreflect.EnumKind, "istio.workload.zds.Version", ""}},
		"WorkloadInfo": {"name": {1, protoreflect.StringKind, "", ""}, "namespace": {2, protoreflect.StringKind, "", ""}, "service_account": {3, protoreflect.StringKind, "", ""}},
		"AddWorkload":  {"uid": {1, protoreflect.StringKind, "", ""}, "workload_info": {2, protoreflect.MessageKind, "istio.workload.zds.WorkloadInfo", ""}},
		"KeepWorkload": {"uid": {1, protoreflect.StringKind, "", ""}},
		"DelWorkload":  {"uid": {2, protoreflect.StringKind, "", ""}},
		"SnapshotSent": {},
		"WorkloadRequest": {
			"add":           {1, protoreflect.MessageKind, "istio.workload.zds.AddWorkload", "payload"},
			"del":           {2, protoreflect.MessageKind, "istio.workload.zds.DelWorkload", "payload"},
			"snapshot_sent": {3, protoreflect.MessageKind, "istio.workload.zds.SnapshotSent", "payload"},
			"keep":          {5, protoreflect.MessageKind, "istio.workload.zds.KeepWorkload", "payload"},
		},
		"Ack":              {"error": {1, protoreflect.StringKind, "", ""}},
		"WorkloadResponse": {"ack": {1, protoreflect.MessageKind, "istio.workload.zds.Ack", "payload"}},
	}
	msgs := fd.Messages()
	if msgs.Len() != len(want) {
		t.Errorf("%d messages, want %d", msgs.Len(), len(want))
	}
	for name, fields := range want {
		md := msgs.ByName(protoreflect.Name(name))
		if md == nil {
			t.Errorf("message %s missing", name)
			continue
		}
		if md.Fields().Len() != len(fields) {
			t.Errorf("%s has %d fields, want %d", name, md.Fields().Len(), len(fields))
		}
		for fname, w := range fields {
			f := md.Fields().ByName(protoreflect.Name(fname))
			if f == nil {
				t.Errorf("%s.%s missing", name, fname)
				continue
			}
			if f.Number() != w.num || f.Kind() != w.kind || f.Cardinality() != protoreflect.Optional {
				t.Errorf("%s.%s = #%d %v %v, want #%d %v singular", name, fname, f.Number(), f.Kind(), f.Cardinality(), w.num, w.kind)
			}
			switch w.kind {
			case protoreflect.MessageKind:
				if got := string(f.Message().FullName()); got != w.msg {
					t.Errorf("%s.%s type %s, want %s", name, fname, got, w.msg)
				}
			case protoreflect.EnumKind:
				if got := string(f.Enum().FullName()); got != w.msg {
					t.Errorf("%s.%s type %s, want %s", name, fname, got, w.msg)
				}
			}
			var oneof string
			if o := f.ContainingOneof(); o != nil && !o.IsSynthetic() {
				oneof = string(o.Name())
			}
			if oneof != w.oneof {
				t.Errorf("%s.%s in oneof %q, want %q", name, fname, oneof, w.oneof)
			}
		}
	}
	if r := msgs.ByName("WorkloadInfo").ReservedRanges(); r.Len() != 1 || !r.Has(4) {
		t.Errorf("WorkloadInfo must reserve field 4")
	}
	ed := fd.Enums().ByName("Version")
	if ed == nil || ed.Values().Len() != 2 || ed.Values().ByName("NOT_USED").Number() != 0 || ed.Values().ByName("V1").Number() != 1 {
		t.Errorf("enum Version must be NOT_USED = 0, V1 = 1")
	}
}
