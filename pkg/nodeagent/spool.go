package nodeagent

import (
	"log/slog"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// spoolStep is what handling one spooled event came to.
type spoolStep int

const (
	// spoolKeep: not handled yet; the entry stays for the next round.
	spoolKeep spoolStep = iota
	// spoolDone: handled; the entry goes.
	spoolDone
	// spoolCounted: handled, and counted in the drain's result; the entry
	// goes.
	spoolCounted
)

// drainSpool hands each entry of one of the plugin's spools (the DEL spool
// or the ADD spool, entries as nodefiles lists them) to handle and removes
// the entries handled; unusable entries are logged and removed. It
// returns how many entries handle counted. name ("DEL spool", "ADD
// spool") is for the logs.
func drainSpool(log *slog.Logger, name string, entries []nodefiles.Entry, handle func(ev *ambient.PodEvent) spoolStep) int {
	n := 0
	for _, en := range entries {
		if en.Err != nil {
			log.Warn("dropping unusable "+name+" entry", "path", en.Path, "err", en.Err)
			_ = nodefiles.Remove(en.Path)
			continue
		}
		step := handle(en.Event)
		if step == spoolKeep {
			continue
		}
		if step == spoolCounted {
			n++
		}
		if err := nodefiles.Remove(en.Path); err != nil {
			log.Warn("remove "+name+" entry", "path", en.Path, "err", err)
		}
	}
	return n
}
