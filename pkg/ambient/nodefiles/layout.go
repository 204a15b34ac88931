package nodefiles

import (
	"path/filepath"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// Layout is the agent's run directory: the directory of its socket, a
// root-only host directory that outlives the agent's container, and
// everything in it; and its state directory, a root-only host directory on
// disk that also outlives a reboot. It is the one place those paths are
// spelled; the plugin and the agent both take theirs from it.
type Layout struct {
	socket string
	state  string
}

// ForSocket is the layout around the agent socket at socket: everything
// else lives in the socket's directory, but for the state directory
// (ambient.DefaultStateDir unless WithStateDir says otherwise).
func ForSocket(socket string) Layout { return Layout{socket: socket} }

// WithStateDir is l with its persistent state directory at dir.
func (l Layout) WithStateDir(dir string) Layout {
	l.state = dir
	return l
}

// StateDir is the persistent node directory (on disk, not tmpfs): what
// the plugin decides by when the agent cannot answer, which must survive a
// reboot, and the marker of an uninstall in progress.
func (l Layout) StateDir() string {
	if l.state == "" {
		return ambient.DefaultStateDir
	}
	return l.state
}

// Uninstalling is the marker an uninstall writes in the state directory
// before it removes anything: while it exists and the agent cannot answer,
// the plugin lets every pod through, since the mesh is leaving the node.
func (l Layout) Uninstalling() string { return filepath.Join(l.StateDir(), "uninstalling") }

// InDir is the layout of run directory dir, the agent socket named as by
// default.
func InDir(dir string) Layout {
	return ForSocket(filepath.Join(dir, filepath.Base(ambient.DefaultAgentSocket)))
}

// Default is the layout around ambient.DefaultAgentSocket
// (/var/run/ambient-cni).
func Default() Layout { return ForSocket(ambient.DefaultAgentSocket) }

// Dir is the run directory.
func (l Layout) Dir() string { return filepath.Dir(l.socket) }

// AgentSocket is where the agent serves the plugin.
func (l Layout) AgentSocket() string { return l.socket }

// DebugSocket is where the agent serves its debug endpoints, to root only.
func (l Layout) DebugSocket() string { return l.join("debug.sock") }

// Snapshot is the enablement snapshot the agent writes for the plugin.
func (l Layout) Snapshot() string { return l.join("enablement.json") }

// Heartbeat is the file whose modification time says when the agent was
// last alive.
func (l Layout) Heartbeat() string { return l.join("agent-alive") }

// DelSpool is the directory of the DELs the plugin recorded while the
// agent was unreachable.
func (l Layout) DelSpool() string { return l.join("pending-del") }

// AddSpool is the directory of the ADDs the plugin let through while the
// agent was gone, for the agent to re-check.
func (l Layout) AddSpool() string { return l.join("pending-add") }

// Records is the directory of the agent's capture records.
func (l Layout) Records() string { return l.join("captured") }

// NodeDirsLedger is the note of the host directories the agent created or
// made private, for an uninstall to put back.
func (l Layout) NodeDirsLedger() string { return l.join("node-dirs.json") }

// InstallerState is the installer's copy of the conflists it edited, so
// an uninstall after an agent restart still restores them exactly.
func (l Layout) InstallerState() string { return l.join("installer-state.json") }

// StateSnapshot is the enablement snapshot kept in the state directory:
// the one the plugin decides by, since it survives a reboot.
func (l Layout) StateSnapshot() string { return filepath.Join(l.StateDir(), "enablement.json") }

// ExplicitStateSnapshot is StateSnapshot when the state directory was set
// (WithStateDir), else "": a layout built around a socket alone (a test's)
// never writes into the host's default state directory.
func (l Layout) ExplicitStateSnapshot() string {
	if l.state == "" {
		return ""
	}
	return l.StateSnapshot()
}

// PluginCredential is the plugin's own API credential, in the state
// directory (see package plugincred).
func (l Layout) PluginCredential() string {
	return filepath.Join(l.StateDir(), "plugin-credential.json")
}

// FallbackBinary is the plugin's second tier (ambient-cni-fallback), which
// the agent copies into the state directory and the plugin execs only
// while the agent cannot answer.
func (l Layout) FallbackBinary() string { return filepath.Join(l.StateDir(), "ambient-cni-fallback") }

func (l Layout) join(name string) string { return filepath.Join(l.Dir(), name) }
