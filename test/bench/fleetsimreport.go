package bench

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
)

// WriteReport prints the simulation's figures, one column per system and
// fleet size, then each system's figures extrapolated to 5,000 nodes from
// its two largest fleets. Nothing is asserted.
func (r *FleetSimResult) WriteReport(w io.Writer) error {
	l1, l2 := r.Machine.LoadStart, r.Machine.LoadEnd
	fmt.Fprintf(w, "ambient-cni bench-fleet %s, commit %s: %d CPUs, load %.1f %.1f %.1f at start, %.1f %.1f %.1f at end; %.0f s\n\n",
		r.Started.UTC().Format("2006-01-02 15:04 UTC"), r.Commit, r.Machine.CPUs, l1[0], l1[1], l1[2], l2[0], l2[1], l2[2], r.Seconds)
	if r.Quick {
		fmt.Fprintln(w, "QUICK run (a smoke test of the harness): the figures say nothing about scale.")
	}
	fmt.Fprintln(w, "Each column: N simulated agents (each its own client, connection and source address, holding its system's watches) against one fresh kube-apiserver + etcd; the simulator shares the machine.")
	if r.IstioMissing != "" {
		fmt.Fprintf(w, "istio-cni: not run: %s\n", r.IstioMissing)
	}
	fmt.Fprintln(w)
	head := []string{"figure"}
	for _, run := range r.Runs {
		col := fmt.Sprintf("%s, %d", run.System, run.Nodes)
		if run.Error != "" {
			col += " (failed: partial)"
		}
		head = append(head, col)
	}
	rows := [][]string{head}
	add := func(label string, f func(s *FleetSimRun, n float64) string) {
		row := []string{label}
		for _, run := range r.Runs {
			row = append(row, f(run, float64(run.Nodes)))
		}
		rows = append(rows, row)
	}
	idleRate := func(s *FleetSimRun) float64 { return s.Idle.APIServerCPUSeconds / max(s.Idle.Seconds, 1) }
	add("watches held per agent", func(s *FleetSimRun, _ float64) string { return watchList(s.WatchesPerAgent) })
	add("start, all at once: requests per agent (watches apart) / watches", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.2f / %.2f", float64(s.Start.AgentRequests)/n, float64(s.Start.WatchStarts)/n)
	})
	add("start: all established: s / API server CPU: s", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%.1f / %.1f", s.StartSeconds, s.Start.APIServerCPUSeconds)
	})
	add("rest: API server RSS, no agent / at rest: MiB", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%.0f / %.0f", s.Idle.RSSMiB, s.Rest.RSSMiB)
	})
	add("rest: API server RSS / Go heap beyond no agent, per agent: KiB", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.0f / %.0f", (s.Rest.RSSMiB-s.Idle.RSSMiB)*1024/n, (s.Rest.HeapInuseMiB-s.Idle.HeapInuseMiB)*1024/n)
	})
	add("rest: API server goroutines beyond no agent, per agent", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.1f", (s.Rest.Goroutines-s.Idle.Goroutines)/n)
	})
	add("rest: API server CPU, no agent / at rest: % of a core", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%.1f / %.1f", idleRate(s)*100, s.Rest.APIServerCPUSeconds/max(s.Rest.Seconds, 1)*100)
	})
	add("rest: requests per agent per minute", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.2f", float64(s.Rest.AgentRequests)/n*60/max(s.Rest.Seconds, 1))
	})
	add("rest: events sent per agent per minute (bookmarks)", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.1f", s.Rest.WatchEvents/n*60/max(s.Rest.Seconds, 1))
	})
	add("namespace flip: events per agent / bytes per event", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.2f / %.0f", float64(s.FlipAgentEvents)/n, bytesPerEvent(s.Flip, "namespaces", "Namespace"))
	})
	add("namespace flip: bytes sent, all agents / API server CPU beyond idle: ms", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%s / %.0f", bytesText(s.Flip.WatchEventBytes), (s.Flip.APIServerCPUSeconds-idleRate(s)*s.Flip.Seconds)*1000)
	})
	add("DaemonSet status write: events per agent / bytes per event", func(s *FleetSimRun, n float64) string {
		if s.StatusWrites == 0 {
			return ""
		}
		ev := float64(s.StatusAgentEvents) / float64(s.StatusWrites)
		if ev == 0 {
			return "0 / -"
		}
		return fmt.Sprintf("%.2f / %.0f", ev/n, bytesPerEvent(s.Status, "daemonsets", "DaemonSet"))
	})
	add("DaemonSet status write: bytes sent, all agents", func(s *FleetSimRun, _ float64) string {
		return bytesText(statusBytesPerWrite(s))
	})
	add("DaemonSet rollout (N status writes): bytes sent", func(s *FleetSimRun, n float64) string {
		return bytesText(statusBytesPerWrite(s) * n)
	})
	add("restart wave, all at once: all established: s / API server CPU: s", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%.1f / %.1f", s.RestartSeconds, s.Restart.APIServerCPUSeconds)
	})
	add("restart wave: requests / events per agent (bytes)", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.2f / %.1f (%s)", float64(s.Restart.AgentRequests)/n, s.Restart.WatchEvents/n, bytesText(s.Restart.WatchEventBytes/n))
	})
	add("API server restarted (cache cold): all back: s / API server CPU: s", func(s *FleetSimRun, _ float64) string {
		if s.APIRestartError != "" {
			return "not measured: " + s.APIRestartError
		}
		return fmt.Sprintf("%.1f / %.1f", s.APIRestartSeconds, s.APIRestart.APIServerCPUSeconds)
	})
	add("API server restarted: requests / events per agent (bytes)", func(s *FleetSimRun, n float64) string {
		return fmt.Sprintf("%.2f / %.1f (%s)", float64(s.APIRestart.AgentRequests)/n, s.APIRestart.WatchEvents/n, bytesText(s.APIRestart.WatchEventBytes/n))
	})
	add("restart wave: mean event by resource", func(s *FleetSimRun, _ float64) string { return resourceBytes(s.Restart) })
	add("API server peak RSS (VmHWM) over the run: MiB", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%.0f", s.Restart.PeakRSSMiB)
	})
	add("the simulator's own CPU over the run: s", func(s *FleetSimRun, _ float64) string {
		return fmt.Sprintf("%.0f", s.SimCPUSeconds)
	})
	writeMarkdown(w, rows)

	ex := r.extrapolate(5000)
	if len(ex) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "At 5,000 nodes, a straight line through each system's two largest fleets:")
	fmt.Fprintln(w)
	rows = [][]string{{"at 5,000 nodes"}}
	for _, e := range ex {
		rows[0] = append(rows[0], fmt.Sprintf("%s (from %d and %d)", e.system, e.from[0], e.from[1]))
	}
	labels := []string{"API server RSS at rest: MiB", "API server goroutines at rest", "restart wave: API server CPU: s",
		"namespace flip: bytes sent", "DaemonSet status write: bytes sent", "DaemonSet rollout: bytes sent"}
	for i, l := range labels {
		row := []string{l}
		for _, e := range ex {
			row = append(row, e.values[i])
		}
		rows = append(rows, row)
	}
	writeMarkdown(w, rows)
	for _, run := range r.Runs {
		if run.Error != "" {
			fmt.Fprintf(w, "\n%s, %d nodes failed: %s\n", run.System, run.Nodes, run.Error)
		}
	}
	return nil
}

// statusBytesPerWrite is what one DaemonSet status write sent to every
// agent together: the events the agents received times the bytes of one.
func statusBytesPerWrite(s *FleetSimRun) float64 {
	if s.StatusWrites == 0 || s.StatusAgentEvents == 0 {
		return 0
	}
	return float64(s.StatusAgentEvents) / float64(s.StatusWrites) * bytesPerEvent(s.Status, "daemonsets", "DaemonSet")
}

// bytesPerEvent is the mean size of the events of the resource (its
// label as resource, or as kind) over p, or of every event when the API
// server counted none by resource.
func bytesPerEvent(p FleetPhase, names ...string) float64 {
	for _, n := range names {
		if e, ok := p.EventsByResource[n]; ok && e.Events > 0 {
			return e.Bytes / e.Events
		}
	}
	return p.WatchEventBytes / max(p.WatchEvents, 1)
}

// resourceBytes is "pods 4.1 KB, namespaces 0.4 KB": the mean event of
// each resource over p.
func resourceBytes(p FleetPhase) string {
	var out []string
	for _, res := range slices.Sorted(maps.Keys(p.EventsByResource)) {
		// The agents' resources; the API server's own clients watch
		// the rest.
		if !slices.Contains([]string{"pods", "Pod", "namespaces", "Namespace", "services", "Service", "daemonsets", "DaemonSet"}, res) {
			continue
		}
		e := p.EventsByResource[res]
		out = append(out, fmt.Sprintf("%s %s", res, bytesText(e.Bytes/max(e.Events, 1))))
	}
	return strings.Join(out, ", ")
}

type simExtrapolation struct {
	system string
	from   [2]int
	values []string
}

// extrapolate fits each figure of a system through its two largest
// fleets and reads it at n nodes.
func (r *FleetSimResult) extrapolate(n float64) []simExtrapolation {
	var out []simExtrapolation
	var systems []string
	for _, run := range r.Runs {
		if !slices.Contains(systems, run.System) {
			systems = append(systems, run.System)
		}
	}
	for _, sys := range systems {
		var runs []*FleetSimRun
		for _, run := range r.Runs {
			if run.System == sys && run.Error == "" {
				runs = append(runs, run)
			}
		}
		slices.SortFunc(runs, func(a, b *FleetSimRun) int { return a.Nodes - b.Nodes })
		if len(runs) < 2 {
			continue
		}
		a, b := runs[len(runs)-2], runs[len(runs)-1]
		at := func(f func(*FleetSimRun) float64) float64 {
			fa, fb := f(a), f(b)
			return fa + (fb-fa)/float64(b.Nodes-a.Nodes)*(n-float64(a.Nodes))
		}
		write := at(statusBytesPerWrite)
		out = append(out, simExtrapolation{system: sys, from: [2]int{a.Nodes, b.Nodes}, values: []string{
			fmt.Sprintf("%.0f", at(func(s *FleetSimRun) float64 { return s.Rest.RSSMiB })),
			fmt.Sprintf("%.0f", at(func(s *FleetSimRun) float64 { return s.Rest.Goroutines })),
			fmt.Sprintf("%.0f", at(func(s *FleetSimRun) float64 { return s.Restart.APIServerCPUSeconds })),
			bytesText(at(func(s *FleetSimRun) float64 { return s.Flip.WatchEventBytes })),
			bytesText(write),
			bytesText(write * n),
		}})
	}
	return out
}

// bytesText is b in B, KB, MB or GB (powers of ten).
func bytesText(b float64) string {
	switch {
	case b >= 1e9:
		return fmt.Sprintf("%.1f GB", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1f MB", b/1e6)
	case b >= 1e3:
		return fmt.Sprintf("%.1f KB", b/1e3)
	}
	return fmt.Sprintf("%.0f B", b)
}
