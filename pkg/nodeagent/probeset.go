package nodeagent

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
)

// addProbeIPs puts a pod's IPs in the host probe set. A failure costs the
// pod its kubelet probes' bypass, not its capture, so it is logged and
// counted rather than failing the enroll.
func (a *Agent) addProbeIPs(log *slog.Logger, ips []netip.Addr) {
	if a.cfg.HostProbe == nil {
		return
	}
	for _, ip := range ips {
		if err := a.cfg.HostProbe.AddIP(ip); err != nil {
			a.ruleError("probe")
			log.Warn("add pod IP to host probe set", "ip", ip, "err", err)
		}
	}
}

// dropProbeIPs removes IPs from the host probe set, except those in keep
// and those another enrolled pod holds (an IP reused before a late DEL).
func (a *Agent) dropProbeIPs(log *slog.Logger, ips, keep []netip.Addr) {
	if a.cfg.HostProbe == nil {
		return
	}
	inUse := a.enrolledIPs()
	for _, ip := range ips {
		if slices.Contains(keep, ip) || inUse[ip] {
			continue
		}
		if err := a.cfg.HostProbe.DelIP(ip); err != nil {
			a.ruleError("probe")
			log.Warn("remove pod IP from host probe set", "ip", ip, "err", err)
		}
	}
}

func (a *Agent) enrolledIPs() map[netip.Addr]bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[netip.Addr]bool{}
	for _, e := range a.entriesLocked() {
		for _, ip := range e.IPs {
			out[ip] = true
		}
	}
	return out
}

// EnsureHostProbe creates the host probe set and its rule; call it at
// startup, before pods are restored into it.
func (a *Agent) EnsureHostProbe() error {
	if a.cfg.HostProbe == nil {
		return nil
	}
	if err := a.cfg.HostProbe.Ensure(); err != nil {
		return fmt.Errorf("host probe set: %w", err)
	}
	return nil
}

// RemoveHostProbe takes the host probe set and its rule away; only an
// uninstall does, since an upgrade's next agent keeps the pods' probes.
func (a *Agent) RemoveHostProbe() error {
	if a.cfg.HostProbe == nil {
		return nil
	}
	if err := a.cfg.HostProbe.Remove(); err != nil {
		return fmt.Errorf("remove host probe set: %w", err)
	}
	return nil
}

// SyncHostProbe makes the host probe set hold exactly the enrolled pods'
// IPs. Call it once the state is restored after a restart: pods deleted
// while the agent was down leave their IPs behind otherwise. An entry is
// never pruned while it may belong to a pod whose state is unknown: while
// an unresolved pod's IPs are unknown (its status lost them), nothing is
// removed, and the prune runs once the last such pod is resolved or gone.
// The IPs of pods known only by their capture record are kept too (not
// added): the agent may have left capture on them, until released.
func (a *Agent) SyncHostProbe() error {
	if a.cfg.HostProbe == nil {
		return nil
	}
	have, err := a.cfg.HostProbe.IPs()
	if err != nil {
		return fmt.Errorf("list host probe set: %w", err)
	}
	want := a.enrolledIPs()
	unknown := a.unresolvedWithoutIPs()
	a.mu.Lock()
	a.probePruneDeferred = unknown > 0
	a.mu.Unlock()
	if unknown > 0 {
		a.log.Info("host probe set not pruned: pods restored without their netns have unknown IPs", "pods", unknown)
	}
	recorded := map[netip.Addr]bool{}
	for _, r := range a.records.all() {
		for _, ip := range r.IPs {
			recorded[ip] = true
		}
	}
	var errs []error
	inSet := make(map[netip.Addr]bool, len(have))
	for _, ip := range have {
		inSet[ip] = true
		if !want[ip] && !recorded[ip] && unknown == 0 {
			errs = append(errs, a.cfg.HostProbe.DelIP(ip))
		}
	}
	for ip := range want {
		if !inSet[ip] {
			errs = append(errs, a.cfg.HostProbe.AddIP(ip))
		}
	}
	return errors.Join(errs...)
}

// unresolvedWithoutIPs counts the unresolved pods whose IPs are unknown.
func (a *Agent) unresolvedWithoutIPs() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, e := range a.entriesLocked() {
		if e.Unresolved && len(e.IPs) == 0 {
			n++
		}
	}
	return n
}

// unresolvedGone runs the probe-set prune SyncHostProbe deferred, once no
// unresolved pod with unknown IPs is left. Call it after an unresolved
// entry was replaced or removed.
func (a *Agent) unresolvedGone() {
	a.mu.Lock()
	deferred := a.probePruneDeferred
	a.mu.Unlock()
	if !deferred || a.unresolvedWithoutIPs() > 0 {
		return
	}
	if err := a.SyncHostProbe(); err != nil {
		a.log.Warn("sync host probe set", "err", err)
	}
}
