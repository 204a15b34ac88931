package installer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// The state file carries the records (what we replaced in which config)
// across agent restarts, so an uninstall after an upgrade still restores
// the primary's exact bytes and a converted .conf. It is only an aid: a
// record is used only while the file still holds exactly what we wrote,
// so a stale or missing state file just means falling back to Unchain.

const (
	stateVersion     = 1
	maxStateSize     = 16 << 20
	maxStateRecords  = 64
	stateFileMode    = 0o600
	stateFileDirMode = 0o700
	stateNote        = "ambient-cni installer state: original CNI configs replaced by chaining"
)

type stateFile struct {
	Note    string        `json:"note"`
	Version int           `json:"version"`
	Records []stateRecord `json:"records"`
}

type stateRecord struct {
	Path     string      `json:"path"`
	Written  []byte      `json:"written"`
	OrigPath string      `json:"origPath"`
	Orig     []byte      `json:"orig,omitempty"`
	OrigMode fs.FileMode `json:"origMode"`
}

// loadState reads the state file once, keeping only records that point
// into the conf dir: the file is root-only, but a record makes us write
// as root, so nothing outside the conf dir is trusted from it.
func (i *Installer) loadState() {
	if i.stateLoaded || i.cfg.StateFile == "" {
		return
	}
	i.stateLoaded = true
	f, err := os.Open(i.cfg.StateFile)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err != nil {
		i.log.Warn("cannot read installer state; restoring by removing our entry only", "file", i.cfg.StateFile, "err", err)
		return
	}
	defer f.Close()
	// An older version's file may be open to others; close it now, not
	// only at the next save, which a pass with nothing to do never makes.
	if fi, err := f.Stat(); err == nil && fi.Mode().Perm()&^stateFileMode != 0 {
		if err := f.Chmod(fi.Mode().Perm() & stateFileMode); err != nil {
			i.log.Warn("cannot make the installer state private", "file", i.cfg.StateFile, "err", err)
		}
	}
	b, err := io.ReadAll(io.LimitReader(f, maxStateSize+1))
	if err == nil && len(b) > maxStateSize {
		err = fmt.Errorf("larger than %d bytes", maxStateSize)
	}
	var st stateFile
	if err == nil {
		err = json.Unmarshal(b, &st)
	}
	if err == nil && st.Version != stateVersion {
		err = fmt.Errorf("unknown version %d", st.Version)
	}
	if err != nil {
		i.log.Warn("ignoring unusable installer state", "file", i.cfg.StateFile, "err", err)
		return
	}
	n := 0
	for _, r := range st.Records {
		if !i.inConfDir(r.Path) || !i.inConfDir(r.OrigPath) || len(r.Written) == 0 || n >= maxStateRecords {
			continue
		}
		if _, ok := i.records[r.Path]; ok {
			continue // this run's own knowledge is newer
		}
		i.records[r.Path] = &record{written: r.Written, origPath: r.OrigPath, orig: r.Orig, origMode: r.OrigMode.Perm()}
		n++
	}
	if n > 0 {
		i.log.Info("loaded installer state", "file", i.cfg.StateFile, "records", n)
	}
}

func (i *Installer) inConfDir(p string) bool {
	return filepath.IsAbs(p) && filepath.Dir(p) == i.cfg.ConfDir && isConfigName(filepath.Base(p))
}

// saveState writes the records; failure only loses the restart aid.
func (i *Installer) saveState() {
	if i.cfg.StateFile == "" {
		return
	}
	st := stateFile{Note: stateNote, Version: stateVersion}
	for p, r := range i.records {
		if !i.inConfDir(p) || len(st.Records) >= maxStateRecords {
			continue
		}
		st.Records = append(st.Records, stateRecord{Path: p, Written: r.written, OrigPath: r.origPath, Orig: r.orig, OrigMode: r.origMode})
	}
	b, err := json.Marshal(st)
	if err == nil {
		err = os.MkdirAll(filepath.Dir(i.cfg.StateFile), stateFileDirMode)
	}
	if err == nil {
		err = atomicfile.WriteFile(i.cfg.StateFile, b, atomicfile.Options{Mode: stateFileMode})
	}
	if err != nil {
		i.log.Warn("cannot save installer state", "file", i.cfg.StateFile, "err", err)
	}
}

// dropState removes the state file after a real uninstall.
func (i *Installer) dropState() {
	if i.cfg.StateFile == "" {
		return
	}
	if err := os.Remove(i.cfg.StateFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
		i.log.Warn("cannot remove installer state", "file", i.cfg.StateFile, "err", err)
	}
}
