package attest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	slsa "github.com/in-toto/attestation/go/predicates/provenance/v1"
	intoto "github.com/in-toto/attestation/go/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// Predicate types and the in-toto payload type (what cosign
// verify-attestation's --type spdxjson and slsaprovenance1 look for).
const (
	InTotoPayloadType   = "application/vnd.in-toto+json"
	SPDXPredicateType   = "https://spdx.dev/Document"
	SLSAProvenanceV1    = "https://slsa.dev/provenance/v1"
	StatementTypeV1     = intoto.StatementTypeUri
	provenanceBuildType = "/blob/main/docs/release.md#provenance"
)

// ProvenanceInput is what a release's provenance records.
type ProvenanceInput struct {
	// Name is the image's repository (REGISTRY/ambient-cni), Index the
	// image index's digest: the statement's subject.
	Name  string
	Index v1.Hash
	// Version, Registry: the release's parameters. Source is the
	// project's repository URL, Commit the released commit.
	Version, Registry, Source, Commit string
	// GoSum is the go.sum the binaries were built with; GoVersion the
	// toolchain that built them.
	GoSum     []byte
	GoVersion string
	// Bases maps each architecture to its Debian base's tarball's
	// sha256 (hack/kube-tools.sh image-rootfs-ARCH).
	Bases map[string]string
	// Platforms names each architecture's image manifest digest.
	Platforms map[string]v1.Hash
}

// FileSHA256 is the hex sha256 of the file at p: how the provenance names
// each architecture's Debian base (ProvenanceInput.Bases).
func FileSHA256(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Provenance returns the release's SLSA v1 provenance as an in-toto
// Statement whose subject is the image index. It records no times, so the
// same release gives the same bytes.
func Provenance(in ProvenanceInput) ([]byte, error) {
	if in.Commit == "" || in.Source == "" || len(in.GoSum) == 0 {
		return nil, errors.New("provenance: the commit, the source repository and go.sum are required")
	}
	gosum := sha256.Sum256(in.GoSum)
	deps := []*intoto.ResourceDescriptor{
		{Uri: "git+" + in.Source + "@refs/tags/v" + in.Version, Digest: map[string]string{"gitCommit": in.Commit}},
		{Name: "go.sum", Digest: map[string]string{"sha256": hex.EncodeToString(gosum[:])}},
		{Uri: "pkg:golang/stdlib@" + in.GoVersion, Name: "go toolchain"},
	}
	for _, arch := range slices.Sorted(maps.Keys(in.Bases)) {
		deps = append(deps, &intoto.ResourceDescriptor{
			Name:   "image-rootfs-" + arch,
			Digest: map[string]string{"sha256": in.Bases[arch]},
		})
	}
	ext, err := structpb.NewStruct(map[string]any{"version": in.Version, "registry": in.Registry, "source": in.Source})
	if err != nil {
		return nil, err
	}
	plat := map[string]any{}
	for arch, d := range in.Platforms {
		plat["linux/"+arch] = d.String()
	}
	internal, err := structpb.NewStruct(map[string]any{"platforms": plat})
	if err != nil {
		return nil, err
	}
	pred := &slsa.Provenance{
		BuildDefinition: &slsa.BuildDefinition{
			BuildType:            in.Source + provenanceBuildType,
			ExternalParameters:   ext,
			InternalParameters:   internal,
			ResolvedDependencies: deps,
		},
		RunDetails: &slsa.RunDetails{
			Builder: &slsa.Builder{Id: in.Source + "/blob/main/hack/release.sh"},
		},
	}
	if err := pred.Validate(); err != nil {
		return nil, fmt.Errorf("provenance: %w", err)
	}
	predJSON, err := protojson.Marshal(pred)
	if err != nil {
		return nil, err
	}
	return Statement(in.Name, in.Index, SLSAProvenanceV1, predJSON)
}

// Statement returns an in-toto v1 Statement of one subject (name at
// digest) with the predicate given as JSON, as stable, indented JSON.
func Statement(name string, digest v1.Hash, predicateType string, predicate []byte) ([]byte, error) {
	p := &structpb.Struct{}
	if err := protojson.Unmarshal(predicate, p); err != nil {
		return nil, fmt.Errorf("the %s predicate: %w", predicateType, err)
	}
	st := &intoto.Statement{
		Type:          intoto.StatementTypeUri,
		Subject:       []*intoto.ResourceDescriptor{{Name: name, Digest: map[string]string{digest.Algorithm: digest.Hex}}},
		PredicateType: predicateType,
		Predicate:     p,
	}
	if err := st.Validate(); err != nil {
		return nil, err
	}
	return stableJSON(st)
}

// stableJSON marshals a message as indented JSON with sorted keys:
// protojson varies its whitespace on purpose, and a release's files must
// be the same bytes each time.
func stableJSON(m proto.Message) ([]byte, error) {
	b, err := protojson.Marshal(m)
	if err != nil {
		return nil, err
	}
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	out, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

// ParseStatement decodes an in-toto Statement and checks it is one (v1,
// or v0.1 as older tools write).
func ParseStatement(b []byte) (*intoto.Statement, error) {
	st := &intoto.Statement{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, st); err != nil {
		return nil, fmt.Errorf("not an in-toto statement: %w", err)
	}
	if !strings.HasPrefix(st.GetType(), "https://in-toto.io/Statement/") {
		return nil, fmt.Errorf("not an in-toto statement: _type %q", st.GetType())
	}
	return st, nil
}

// PredicateJSON returns a statement's predicate as JSON.
func PredicateJSON(st *intoto.Statement) ([]byte, error) {
	return protojson.Marshal(st.GetPredicate())
}
