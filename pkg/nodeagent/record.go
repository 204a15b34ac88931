package nodeagent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// Record is the agent's node-local note that it may have left capture on a
// pod: written before the pod's rules are applied, removed only once
// everything the agent did to the pod is undone (or the pod's sandbox is
// gone). A new agent adopts every recorded pod, so a crash at any step
// leaves a pod the next agent finds, even one whose annotation was never
// written or was already cleared. One small file per pod.
type Record struct {
	UID       types.UID `json:"uid"`
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	// SandboxID is empty for pods the controller captured.
	SandboxID string `json:"sandboxID,omitempty"`
	// Network is the CNI network of the sandbox's ADD (empty for the
	// controller's pods and records of older agents).
	Network string `json:"network,omitempty"`
	// Netns is the path the namespace was opened from; NetnsDev and
	// NetnsIno identify it (a path can be reused, an identity cannot
	// while the namespace lives).
	Netns    string       `json:"netns"`
	NetnsDev uint64       `json:"netnsDev"`
	NetnsIno uint64       `json:"netnsIno"`
	IPs      []netip.Addr `json:"ips,omitempty"`
}

// recordSuffix marks complete records; atomicfile's temp files lack it.
const recordSuffix = ".json"

// maxRecordBytes bounds one record file; a record is a few hundred bytes.
const maxRecordBytes = 16 << 10

// validRecordUID reports whether uid can name a record file: Kubernetes
// UIDs are UUIDs; anything else must not escape the directory.
func validRecordUID(uid types.UID) bool {
	if uid == "" || len(uid) > 128 {
		return false
	}
	for _, c := range uid {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// recordStore reads and writes the records. Every write of a pod's record
// bumps the pod's generation, so a removal decided earlier (an unenroll
// waiting for its annotation write) cannot delete the record of a capture
// that happened since. What is on disk, and the generation, are kept in
// the pod's life (podLife.record, recordGen), for cheap lookups.
type recordStore struct {
	dir string
	t   *lifeTable

	// mu serializes the file operations with the lives' record fields
	// (taken before t.mu, never after), so a removal checks a generation
	// and removes the file with no write in between.
	mu  sync.Mutex
	seq uint64
}

func newRecordStore(dir string, t *lifeTable) *recordStore {
	return &recordStore{dir: dir, t: t}
}

func (s *recordStore) path(uid types.UID) string {
	return filepath.Join(s.dir, string(uid)+recordSuffix)
}

// write stores r (replacing the pod's previous record) without fsync: it
// only has to survive the agent, not the node.
func (s *recordStore) write(r Record) error {
	if !validRecordUID(r.UID) {
		return fmt.Errorf("capture record: pod uid %q cannot name a file", r.UID)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("capture record: encode: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := atomicfile.WriteFile(s.path(r.UID), b, atomicfile.Options{Mode: 0o600, SkipSync: true}); err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("capture record: %w", err)
		}
		// First record (or the directory was removed): create it, root only.
		if err := os.MkdirAll(s.dir, 0o700); err != nil {
			return fmt.Errorf("capture record: create %s: %w", s.dir, err)
		}
		if err := atomicfile.WriteFile(s.path(r.UID), b, atomicfile.Options{Mode: 0o600, SkipSync: true}); err != nil {
			return fmt.Errorf("capture record: %w", err)
		}
	}
	s.seq++
	s.t.mu.Lock()
	l := s.t.lifeLocked(r.UID)
	l.record, l.recordGen = &r, s.seq
	s.t.mu.Unlock()
	return nil
}

// generation is the pod's current record generation (0: none written by
// this agent).
func (s *recordStore) generation(uid types.UID) uint64 {
	s.t.mu.Lock()
	defer s.t.mu.Unlock()
	if l := s.t.lives[uid]; l != nil {
		return l.recordGen
	}
	return 0
}

// removeIf removes the pod's record unless it was rewritten since gen.
func (s *recordStore) removeIf(uid types.UID, gen uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.generation(uid) != gen {
		return nil
	}
	return s.removeLocked(uid)
}

// remove removes the pod's record; a missing one is fine.
func (s *recordStore) remove(uid types.UID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.removeLocked(uid)
}

func (s *recordStore) removeLocked(uid types.UID) error {
	s.t.mu.Lock()
	if l := s.t.lives[uid]; l != nil {
		l.record, l.recordGen = nil, 0
		s.t.tidyLocked(l)
	}
	s.t.mu.Unlock()
	if !validRecordUID(uid) {
		return nil
	}
	if err := os.Remove(s.path(uid)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove capture record of %s: %w", uid, err)
	}
	return nil
}

// removeAll removes every known record and returns how many there were.
func (s *recordStore) removeAll() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	recs := s.all()
	for _, r := range recs {
		errs = append(errs, s.removeLocked(r.UID))
	}
	return len(recs), errors.Join(errs...)
}

// get returns the pod's record as last read or written.
func (s *recordStore) get(uid types.UID) (Record, bool) {
	s.t.mu.Lock()
	defer s.t.mu.Unlock()
	if l := s.t.lives[uid]; l != nil && l.record != nil {
		return *l.record, true
	}
	return Record{}, false
}

// byName finds a recorded pod by namespace and name.
func (s *recordStore) byName(namespace, name string) (Record, bool) {
	s.t.mu.Lock()
	defer s.t.mu.Unlock()
	for _, l := range s.t.lives {
		if r := l.record; r != nil && r.Namespace == namespace && r.Name == name {
			return *r, true
		}
	}
	return Record{}, false
}

// all returns every known record.
func (s *recordStore) all() []Record {
	s.t.mu.Lock()
	defer s.t.mu.Unlock()
	var out []Record
	for _, l := range s.t.lives {
		if l.record != nil {
			out = append(out, *l.record)
		}
	}
	return out
}

// load reads the directory (a previous agent's records) into the store.
// Unusable files (not regular, oversized, undecodable, misnamed) and
// leftover temp files are removed and reported in the returned error;
// the usable records are loaded regardless. A missing directory is empty.
func (s *recordStore) load() error {
	des, err := os.ReadDir(s.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read capture records %s: %w", s.dir, err)
	}
	var bad []error
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, de := range des {
		name := de.Name()
		p := filepath.Join(s.dir, name)
		if atomicfile.IsTemp(name) {
			_ = os.Remove(p)
			continue
		}
		r, err := readRecord(p)
		if err == nil && (!strings.HasSuffix(name, recordSuffix) || string(r.UID)+recordSuffix != name) {
			err = errors.New("file name does not match the record's uid")
		}
		if err != nil {
			bad = append(bad, fmt.Errorf("%s: %w", name, err))
			_ = os.Remove(p)
			continue
		}
		s.t.mu.Lock()
		s.t.lifeLocked(r.UID).record = &r
		s.t.mu.Unlock()
	}
	if len(bad) > 0 {
		return fmt.Errorf("removed unusable capture records: %w", errors.Join(bad...))
	}
	return nil
}

func readRecord(p string) (Record, error) {
	// O_NOFOLLOW: a symlink planted in the directory must not make the
	// agent read some other file.
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return Record{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Record{}, err
	}
	if !st.Mode().IsRegular() {
		return Record{}, errors.New("not a regular file")
	}
	b, err := io.ReadAll(io.LimitReader(f, maxRecordBytes+1))
	if err != nil {
		return Record{}, err
	}
	if len(b) > maxRecordBytes {
		return Record{}, fmt.Errorf("larger than %d bytes", maxRecordBytes)
	}
	return parseRecord(b)
}

// parseRecord decodes and checks one record.
func parseRecord(b []byte) (Record, error) {
	var r Record
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return Record{}, fmt.Errorf("decode: %w", err)
	}
	if dec.More() {
		return Record{}, errors.New("trailing data")
	}
	if !validRecordUID(r.UID) {
		return Record{}, fmt.Errorf("invalid uid %q", r.UID)
	}
	if r.Namespace == "" || r.Name == "" || len(r.Namespace) > 253 || len(r.Name) > 253 {
		return Record{}, errors.New("namespace and name required, at most 253 bytes each")
	}
	if len(r.SandboxID) > 253 || len(r.Network) > 253 || len(r.Netns) > 4096 || strings.ContainsRune(r.Netns, 0) {
		return Record{}, errors.New("sandbox id or netns path too long or invalid")
	}
	if len(r.IPs) > 16 {
		return Record{}, errors.New("more than 16 IPs")
	}
	for _, ip := range r.IPs {
		if !ip.IsValid() {
			return Record{}, errors.New("invalid IP")
		}
	}
	return r, nil
}

// sameRecord reports whether two records say the same.
func sameRecord(a, b Record) bool {
	if a.UID != b.UID || a.Namespace != b.Namespace || a.Name != b.Name || a.SandboxID != b.SandboxID ||
		a.Netns != b.Netns || a.NetnsDev != b.NetnsDev || a.NetnsIno != b.NetnsIno || len(a.IPs) != len(b.IPs) {
		return false
	}
	for i := range a.IPs {
		if a.IPs[i] != b.IPs[i] {
			return false
		}
	}
	return true
}
