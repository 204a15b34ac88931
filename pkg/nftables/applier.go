package nftables

import (
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"sync"

	gnft "github.com/google/nftables"

	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Applier installs, verifies and removes the in-pod rules as nf_tables
// tables (inet istio-ambient-raw, -mangle, -nat) over netlink, in one
// atomic batch per pod for both families, plus the policy route. It holds
// no per-namespace state, so one Applier serves every pod and is safe for
// concurrent use. Close waits for connections it closes in the
// background.
type Applier struct {
	log    *slog.Logger
	router policyroute.Router
	// stripes serialise Apply and Remove per namespace path.
	stripes [64]sync.Mutex
	// closing tracks connections closed in the background: closing a
	// socket whose batch deleted rules waits for the kernel (10-25 ms), so
	// the caller does not.
	closing sync.WaitGroup
}

// Option configures an Applier or HostProbe.
type Option func(*options)

type options struct {
	router policyroute.Router
}

// WithRouter replaces the policy-route side (tests use a fake).
func WithRouter(r policyroute.Router) Option { return func(o *options) { o.router = r } }

func apply(opts []Option) options {
	o := options{router: policyroute.Netlink{}}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// NewApplier returns an Applier.
func NewApplier(log *slog.Logger, opts ...Option) *Applier {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	o := apply(opts)
	return &Applier{log: log.With("component", "nftables"), router: o.router}
}

// Close waits for background connection closes to finish.
func (a *Applier) Close() error {
	a.closing.Wait()
	return nil
}

func (a *Applier) lock(netnsPath string) func() {
	h := fnv.New32a()
	_, _ = h.Write([]byte(netnsPath))
	m := &a.stripes[h.Sum32()%uint32(len(a.stripes))]
	m.Lock()
	return m.Unlock
}

// release closes c: at once, or in the background after a batch that
// deleted something.
func (a *Applier) release(c conn, deleted bool) {
	if !deleted {
		_ = c.CloseLasting()
		return
	}
	a.closing.Go(func() { _ = c.CloseLasting() })
}

// podNetns refuses an empty path: it would mean the agent's own (the
// host's) namespace, never a pod's.
func podNetns(path string) error {
	if path == "" {
		return errors.New("pod netns path is empty")
	}
	return nil
}

// routes lists the families whose policy route belongs to the desired
// state: IPv4 always, IPv6 when the namespace and its lo have it.
func routes(st policyroute.NetnsState) []ruleset.Family {
	if st.IPv6 && st.IPv6Loopback {
		return ruleset.Families
	}
	return []ruleset.Family{ruleset.IPv4}
}

// Apply installs cfg's rules in the namespace: the policy routes, then one
// nf_tables batch that replaces our tables with the desired ones (both
// families in inet tables). When the tables already hold exactly the
// desired rules, nothing is written. It is all or nothing: when the batch
// fails, the routes it added are removed again and the namespace is as it
// was.
func (a *Applier) Apply(netnsPath string, cfg ruleset.PodConfig) error {
	if err := podNetns(netnsPath); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	p, err := renderPod(cfg)
	if err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	st, err := a.router.State(netnsPath)
	if err != nil {
		return err
	}
	if !st.LoopbackUp {
		return fmt.Errorf("lo is down in netns %s: redirected traffic could not reach ztunnel", netnsPath)
	}
	c, err := dial(netnsPath)
	if err != nil {
		return err
	}
	live, err := readLive(c, PodTables, false)
	if err != nil {
		_ = c.CloseLasting()
		return fmt.Errorf("read nf_tables state of netns %s: %w", netnsPath, err)
	}
	rulesOK := len(live) > 0 && len(diff(p, live, PodTables)) == 0

	var added []routeAdded
	var errs []error
	for _, f := range routes(st) {
		parts, err := a.router.EnsurePolicyRoute(netnsPath, f, ruleset.PodRules(cfg, f).Routing)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err))
			break
		}
		added = append(added, routeAdded{f, parts})
	}
	if len(errs) == 0 && !rulesOK {
		// Replace, never patch: our tables are ours alone, so deleting
		// and re-adding them in one transaction is exact and atomic.
		for name := range live {
			c.DelTable(&gnft.Table{Name: name, Family: gnft.TableFamilyINet})
		}
		add(c, p)
		if err := c.Flush(); err != nil {
			errs = append(errs, fmt.Errorf("apply nf_tables rules in netns %s: %w", netnsPath, err))
		}
	}
	a.release(c, len(live) > 0 && !rulesOK)
	if len(errs) > 0 {
		for _, r := range added {
			if r.parts.Any() {
				if err := a.router.RemovePolicyRoute(netnsPath, r.f, ruleset.PodRules(cfg, r.f).Routing, r.parts); err != nil {
					errs = append(errs, fmt.Errorf("undo %s policy routing: %w", r.f, err))
				}
			}
		}
		return errors.Join(errs...)
	}
	a.log.Debug("rules applied", "netns", netnsPath, "changed", !rulesOK)
	return nil
}

type routeAdded struct {
	f     ruleset.Family
	parts policyroute.Parts
}

// Verify compares the namespace with cfg's desired state and returns the
// drift; an empty Drift means the rules are exactly in place. Rules are
// compared by the id each carries (a hash of its rendering), so a rule
// edited or added by hand, or left by another version, shows.
func (a *Applier) Verify(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, error) {
	if err := podNetns(netnsPath); err != nil {
		return ruleset.Drift{}, err
	}
	if err := cfg.Validate(); err != nil {
		return ruleset.Drift{}, err
	}
	p, err := renderPod(cfg)
	if err != nil {
		return ruleset.Drift{}, err
	}
	st, err := a.router.State(netnsPath)
	if err != nil {
		return ruleset.Drift{}, err
	}
	c, err := dial(netnsPath)
	if err != nil {
		return ruleset.Drift{}, err
	}
	defer func() { _ = c.CloseLasting() }()
	live, err := readLive(c, PodTables, false)
	if err != nil {
		return ruleset.Drift{}, fmt.Errorf("read nf_tables state of netns %s: %w", netnsPath, err)
	}
	d := ruleset.Drift{Items: diff(p, live, PodTables)}
	for _, f := range routes(st) {
		want := ruleset.PodRules(cfg, f).Routing
		rule, route, err := a.router.PolicyRouteState(netnsPath, f, want)
		if err != nil {
			return ruleset.Drift{}, fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
		}
		d.Items = append(d.Items, policyroute.Drift(f, want, rule, route)...)
	}
	return d, nil
}

// Remove deletes our tables (whatever options they were applied with) in
// one batch, then the policy routes. Idempotent, and safe when nothing is
// installed.
func (a *Applier) Remove(netnsPath string) error {
	return a.remove(netnsPath, true)
}

// RemoveRules deletes our tables but keeps the policy routes: for moving a
// pod to the other backend, which uses the same routes.
func (a *Applier) RemoveRules(netnsPath string) error {
	return a.remove(netnsPath, false)
}

func (a *Applier) remove(netnsPath string, routing bool) error {
	if err := podNetns(netnsPath); err != nil {
		return err
	}
	defer a.lock(netnsPath)()
	st, err := a.router.State(netnsPath)
	if err != nil {
		return err
	}
	c, err := dial(netnsPath)
	if err != nil {
		return err
	}
	tables, err := c.ListTablesOfFamily(gnft.TableFamilyINet)
	if err != nil {
		_ = c.CloseLasting()
		return fmt.Errorf("list nf_tables tables in netns %s: %w", netnsPath, err)
	}
	n := 0
	for _, t := range tables {
		for _, ours := range PodTables {
			if t.Name == ours {
				c.DelTable(t)
				n++
			}
		}
	}
	if n > 0 {
		err = c.Flush()
	}
	a.release(c, n > 0)
	if err != nil {
		return fmt.Errorf("remove nf_tables rules in netns %s: %w", netnsPath, err)
	}
	if !routing {
		return nil
	}
	fams := []ruleset.Family{ruleset.IPv4}
	if st.IPv6 || st.IPv6Loopback {
		fams = ruleset.Families
	}
	for _, f := range fams {
		if err := a.router.RemovePolicyRoute(netnsPath, f, ruleset.PodRules(ruleset.PodConfig{}, f).Routing, policyroute.All); err != nil {
			return fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
		}
	}
	return nil
}
