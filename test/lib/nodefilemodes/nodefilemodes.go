// Package nodefilemodes checks the modes of what ambient-cni writes on a
// node against docs/deploy.md ("Node files"): nothing in the agent's run
// and state directories lets group or others in (directories 0700, files
// and sockets 0600, the fallback binary 0700), the owned conflist is 0600,
// the primary's conflist our entry is chained into keeps the primary's
// mode, and the plugin binary is 0755. Integration checks a simulated
// node's install, the real-node suite a real one's.
package nodefilemodes

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Node names what ambient-cni wrote on one node.
type Node struct {
	// Private are directories wholly the agent's (its run and state
	// directories): every entry in them, and they themselves, must be
	// closed to group and others.
	Private []string
	// ConfDir is the CNI conf dir; PluginType our entry's type. A config
	// there naming it is ours to check: Primary (the primary's file, or
	// its .conflist when we converted a .conf) must keep PrimaryMode; any
	// other (the owned conflist) must be closed to group and others.
	ConfDir, PluginType string
	Primary             string
	PrimaryMode         fs.FileMode
	// Binaries are the plugin binary's installed copies: 0755, the mode
	// of every CNI plugin (no secret in them; runtimes run them as root).
	Binaries []string
}

// Problems returns one line per entry whose mode breaks the rules, and
// per expected entry that is missing.
func Problems(n Node) []string {
	var out []string
	for _, root := range n.Private {
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			if m := fi.Mode().Perm(); m&0o077 != 0 {
				out = append(out, fmt.Sprintf("%s: mode %04o lets group or others in", p, m))
			}
			return nil
		})
		if err != nil {
			out = append(out, fmt.Sprintf("walk %s: %v", root, err))
		}
	}
	if n.ConfDir != "" {
		ents, err := os.ReadDir(n.ConfDir)
		if err != nil {
			out = append(out, fmt.Sprintf("read %s: %v", n.ConfDir, err))
		}
		for _, e := range ents {
			p := filepath.Join(n.ConfDir, e.Name())
			b, err := os.ReadFile(p)
			if e.IsDir() || err != nil || !bytes.Contains(b, []byte(`"`+n.PluginType+`"`)) {
				continue
			}
			fi, err := os.Stat(p)
			if err != nil {
				out = append(out, err.Error())
				continue
			}
			m := fi.Mode().Perm()
			switch {
			case isPrimary(p, n.Primary) && m != n.PrimaryMode.Perm():
				out = append(out, fmt.Sprintf("%s: the primary's conflist chained in place has mode %04o, want the primary's own %04o", p, m, n.PrimaryMode.Perm()))
			case !isPrimary(p, n.Primary) && m&0o077 != 0:
				out = append(out, fmt.Sprintf("%s: our conflist has mode %04o, want 0600", p, m))
			}
		}
	}
	for _, b := range n.Binaries {
		fi, err := os.Stat(b)
		if err != nil {
			out = append(out, err.Error())
		} else if m := fi.Mode().Perm(); m != 0o755 {
			out = append(out, fmt.Sprintf("%s: plugin binary mode %04o, want 0755", b, m))
		}
	}
	return out
}

// isPrimary reports whether p is the primary's file, or the .conflist we
// made of its .conf.
func isPrimary(p, primary string) bool {
	return p == primary || (strings.HasSuffix(primary, ".conf") && p == primary+"list")
}
