package nodedirs

import (
	"os"
	"path/filepath"
	"testing"
)

func mode(t *testing.T, p string) os.FileMode {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

// ledgerIn is where the agent keeps the ledger: in its run directory.
func ledgerIn(dir string) string { return filepath.Join(dir, "node-dirs.json") }

// Created directories (parents too) go; an existing one gets its mode
// back; a restart in between keeps the first agent's notes.
func TestEnsureRestore(t *testing.T) {
	root := t.TempDir()
	agent := filepath.Join(root, "run", "ambient-cni") // run/ missing too
	zt := filepath.Join(root, "ztunnel")               // exists, loose
	if err := os.Mkdir(zt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(zt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := Ensure(ledgerIn(agent), agent, zt); err != nil {
		t.Fatal(err)
	}
	if mode(t, agent) != 0o700 || mode(t, zt) != 0o700 {
		t.Fatalf("modes %v %v, want both 0700", mode(t, agent), mode(t, zt))
	}
	// A restarted agent finds both existing and private: the ledger keeps
	// what the first one found.
	if err := Ensure(ledgerIn(agent), agent, zt); err != nil {
		t.Fatal(err)
	}
	// The agent's files are its own business; a file somebody else put in
	// the ztunnel directory stays.
	if err := os.WriteFile(filepath.Join(zt, "theirs"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Restore(ledgerIn(agent)); err != nil {
		t.Fatal(err)
	}
	if exists(agent) || exists(filepath.Dir(agent)) {
		t.Errorf("created directories left: %s %v, %s %v", agent, exists(agent), filepath.Dir(agent), exists(filepath.Dir(agent)))
	}
	if mode(t, zt) != 0o755 || !exists(filepath.Join(zt, "theirs")) {
		t.Errorf("existing directory: mode %v (want 0755), its file kept %v", mode(t, zt), exists(filepath.Join(zt, "theirs")))
	}
	if !exists(root) {
		t.Error("a directory that existed before was removed")
	}
}

// A created directory that still holds something not ours stays; so does
// every directory when there is no ledger.
func TestRestoreKeepsWhatIsNotEmptyOrNotNoted(t *testing.T) {
	root := t.TempDir()
	agent := filepath.Join(root, "agent")
	if err := Ensure(ledgerIn(agent), agent); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(agent, "foreign"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Restore(ledgerIn(agent)); err != nil {
		t.Fatal(err)
	}
	if !exists(filepath.Join(agent, "foreign")) || exists(ledgerIn(agent)) {
		t.Errorf("foreign file kept %v, ledger left %v", exists(filepath.Join(agent, "foreign")), exists(ledgerIn(agent)))
	}

	other := filepath.Join(root, "other")
	if err := os.Mkdir(other, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := Restore(ledgerIn(other)); err != nil || !exists(other) {
		t.Errorf("no ledger: Restore = %v, dir kept %v", err, exists(other))
	}
}

// An unusable ledger is started over at Ensure (the agent starts), and
// what exists by then is noted as existing: nothing is removed on a guess.
func TestCorruptLedger(t *testing.T) {
	agent := filepath.Join(t.TempDir(), "agent")
	if err := os.Mkdir(agent, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ledgerIn(agent), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Ensure(ledgerIn(agent), agent); err != nil {
		t.Fatal(err)
	}
	if err := Restore(ledgerIn(agent)); err != nil {
		t.Fatal(err)
	}
	if !exists(agent) {
		t.Error("a directory found existing was removed")
	}
}
