package nftables

import (
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"sync"

	gnft "github.com/google/nftables"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/policyroute"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Applier installs, verifies and removes the in-pod rules as nf_tables
// tables (inet istio-ambient-raw, -mangle, -nat) over netlink, in one
// atomic batch per pod for both families, plus the policy route. Each call
// enters the pod's namespace once, to read its state and open its sockets;
// the rest runs on those sockets. It holds no per-namespace state, so one
// Applier serves every pod and is safe for concurrent use. Close waits for
// connections it closes in the background.
type Applier struct {
	log *slog.Logger
	// stripes serialise Apply and Remove per namespace path. Two pods
	// whose paths share a stripe wait for each other, so there are many:
	// eight ADDs at once share one with a chance of about 3 %.
	stripes [1024]sync.Mutex
	// closing tracks connections closed in the background: closing a
	// socket whose batch deleted rules waits for the kernel (10-25 ms), so
	// the caller does not.
	closing sync.WaitGroup

	mu       sync.Mutex
	programs map[string]program // rendered pod rules by configuration, with their fresh batch

	// beforeFlush, set by tests only, queues more on an apply's batch.
	beforeFlush func(conn)
}

// NewApplier returns an Applier.
func NewApplier(log *slog.Logger) *Applier {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Applier{log: log.With("component", "nftables"), programs: map[string]program{}}
}

// maxPrograms bounds the rendering cache; pods share a handful of
// configurations, so the bound is only a guard.
const maxPrograms = 256

// program renders cfg's rules, or returns them from the cache, with the
// batch that installs them in a namespace without our tables: it depends
// on the program alone, so it is built once and replayed for every new
// pod. Programs are never modified after rendering, so sharing them is
// safe.
func (a *Applier) program(cfg ruleset.PodConfig) (program, error) {
	key := fmt.Sprintf("%+v", cfg.WithDefaults())
	a.mu.Lock()
	p, ok := a.programs[key]
	a.mu.Unlock()
	if ok {
		return p, nil
	}
	p, err := renderPod(cfg)
	if err != nil {
		return program{}, err
	}
	q, err := netfilter.NewRecorder()
	if err != nil {
		return program{}, err
	}
	add(q.Conn, p)
	if p.fresh, err = q.Batch(); err != nil {
		return program{}, fmt.Errorf("nftables: encode pod rules: %w", err)
	}
	a.mu.Lock()
	if len(a.programs) >= maxPrograms {
		clear(a.programs)
	}
	a.programs[key] = p
	a.mu.Unlock()
	return p, nil
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
		_ = c.close()
		return
	}
	a.closing.Go(func() { _ = c.close() })
}

// open enters the namespace once: its state, a route socket and the
// nf_tables sockets (write: also the one for changes), all usable from any
// thread afterwards.
func open(netnsPath string, write bool) (*policyroute.Conn, netns.State, conn, error) {
	var (
		st netns.State
		rt *policyroute.Conn
		c  conn
	)
	err := netns.Do(netnsPath, func() error {
		var err error
		if st, err = netns.ReadState(); err != nil {
			return err
		}
		if rt, err = policyroute.Dial(st.LoopbackIndex); err != nil {
			return err
		}
		c, err = dialHere(write)
		return err
	})
	if err != nil {
		if rt != nil {
			rt.Close()
		}
		return nil, netns.State{}, conn{}, fmt.Errorf("netns %s: %w", netnsPath, err)
	}
	return rt, st, c, nil
}

// openVerify is open for a verify by generation, in the same single entry
// into the namespace (the verifier verifies every pod each period, and
// each entry and socket costs system time): it first reads the
// namespace's nf_tables generation, now, and opens the nf_tables
// connection only when now is not prev, the generation of the last
// clean verify (0: none), since only then are the tables read. Reading
// the generation first means a change made after it moves it, so the
// next verify reads again.
func openVerify(netnsPath string, prev uint32) (*policyroute.Conn, netns.State, conn, uint32, error) {
	var (
		st  netns.State
		rt  *policyroute.Conn
		c   conn
		now uint32
	)
	err := netns.Do(netnsPath, func() error {
		var err error
		// "": the namespace this thread is in now.
		if now, err = netfilter.Generation(""); err != nil {
			return err
		}
		if st, err = netns.ReadState(); err != nil {
			return err
		}
		if rt, err = policyroute.Dial(st.LoopbackIndex); err != nil {
			return err
		}
		if prev != 0 && now == prev {
			return nil
		}
		c, err = dialHere(false)
		return err
	})
	if err != nil {
		if rt != nil {
			rt.Close()
		}
		return nil, netns.State{}, conn{}, 0, fmt.Errorf("netns %s: %w", netnsPath, err)
	}
	return rt, st, c, now, nil
}

// routes lists the families whose policy route belongs to the desired
// state: IPv4 always, IPv6 when the namespace and its lo have it and cfg
// does not leave IPv6 alone.
func routes(st netns.State, cfg ruleset.PodConfig) []ruleset.Family {
	return cfg.Families(st.IPv6 && st.IPv6Loopback)
}

// others is what a call saw of the namespace's other netfilter tables:
// foreign says whether it holds ip or ip6 nf_tables tables.
func others(st netns.State, foreign bool) netfilter.Seen {
	return netfilter.Seen{IPTables: foreign, XTables: len(st.XTables) > 0}
}

// Apply installs cfg's rules in the namespace: the policy routes, then one
// nf_tables batch that replaces our tables with the desired ones (both
// families in inet tables). When the tables already hold exactly the
// desired rules, nothing is written. It is all or nothing: when the batch
// fails, the routes it added are removed again and the namespace is as it
// was.
func (a *Applier) Apply(netnsPath string, cfg ruleset.PodConfig) error {
	_, err := a.ApplySeeing(netnsPath, cfg)
	return err
}

// ApplySeeing is Apply, also reporting what it saw of the namespace's other
// netfilter tables.
func (a *Applier) ApplySeeing(netnsPath string, cfg ruleset.PodConfig) (netfilter.Seen, error) {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return netfilter.Seen{}, err
	}
	if err := cfg.Validate(); err != nil {
		return netfilter.Seen{}, err
	}
	p, err := a.program(cfg)
	if err != nil {
		return netfilter.Seen{}, err
	}
	defer a.lock(netnsPath)()
	rt, st, c, err := open(netnsPath, true)
	if err != nil {
		return netfilter.Seen{}, err
	}
	defer rt.Close()
	if !st.LoopbackUp {
		_ = c.close()
		return netfilter.Seen{}, fmt.Errorf("lo is down in netns %s: redirected traffic could not reach ztunnel", netnsPath)
	}
	live, foreign, err := readLive(c, PodTables, false)
	if err != nil {
		_ = c.close()
		return netfilter.Seen{}, fmt.Errorf("read nf_tables state of netns %s: %w", netnsPath, err)
	}
	seen := others(st, foreign)
	rulesOK := len(live) > 0 && len(diff(p, live, PodTables)) == 0

	var added []routeAdded
	var errs []error
	for _, f := range routes(st, cfg) {
		parts, err := rt.EnsurePolicyRoute(f, ruleset.PodRules(cfg, f).Routing)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err))
			break
		}
		added = append(added, routeAdded{f, parts})
	}
	if len(errs) == 0 && !rulesOK {
		// Replace, never patch: our tables are ours alone, so deleting
		// and re-adding them in one transaction is exact and atomic. A
		// namespace without them (every new pod) takes the program's
		// batch as it is.
		b, err := p.fresh, error(nil)
		if len(live) > 0 || a.beforeFlush != nil {
			for name := range live {
				c.q.DelTable(&gnft.Table{Name: name, Family: gnft.TableFamilyINet})
			}
			add(c.q.Conn, p)
			if a.beforeFlush != nil {
				a.beforeFlush(c)
			}
			b, err = c.q.Batch()
		}
		if err == nil {
			err = c.w.Send(b)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("apply nf_tables rules in netns %s: %w", netnsPath, err))
		}
	}
	a.release(c, len(live) > 0 && !rulesOK)
	if len(errs) > 0 {
		for _, r := range added {
			if r.parts.Any() {
				if err := rt.RemovePolicyRoute(r.f, ruleset.PodRules(cfg, r.f).Routing, r.parts); err != nil {
					errs = append(errs, fmt.Errorf("undo %s policy routing: %w", r.f, err))
				}
			}
		}
		return seen, errors.Join(errs...)
	}
	if cfg.StaleIPv6(st.IPv6 || st.IPv6Loopback) {
		// The rules no longer send IPv6 to ztunnel; its route goes too.
		if err := rt.RemovePolicyRoute(ruleset.IPv6, ruleset.PodRules(cfg, ruleset.IPv6).Routing, policyroute.All); err != nil {
			return seen, fmt.Errorf("remove IPv6 policy routing in netns %s: %w", netnsPath, err)
		}
	}
	a.log.Debug("rules applied", "netns", netnsPath, "changed", !rulesOK)
	return seen, nil
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
	d, _, err := a.VerifySeeing(netnsPath, cfg)
	return d, err
}

// VerifySeeing is Verify, also reporting what it saw of the namespace's other
// netfilter tables.
func (a *Applier) VerifySeeing(netnsPath string, cfg ruleset.PodConfig) (ruleset.Drift, netfilter.Seen, error) {
	d, seen, _, err := a.VerifySeeingGen(netnsPath, cfg, 0)
	return d, seen, err
}

// VerifyGen implements ruleset.GenVerifier: the tables are read only when
// the namespace's nf_tables generation moved from gen.
func (a *Applier) VerifyGen(netnsPath string, cfg ruleset.PodConfig, gen uint32) (ruleset.Drift, uint32, error) {
	d, _, g, err := a.VerifySeeingGen(netnsPath, cfg, gen)
	return d, g, err
}

// VerifySeeingGen is VerifySeeing and VerifyGen at once. With the tables
// not read (the generation unchanged since a clean verify), no other
// backend's nf_tables rules can have appeared either: the Seen says none.
func (a *Applier) VerifySeeingGen(netnsPath string, cfg ruleset.PodConfig, gen uint32) (ruleset.Drift, netfilter.Seen, uint32, error) {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return ruleset.Drift{}, netfilter.Seen{}, 0, err
	}
	if err := cfg.Validate(); err != nil {
		return ruleset.Drift{}, netfilter.Seen{}, 0, err
	}
	p, err := a.program(cfg)
	if err != nil {
		return ruleset.Drift{}, netfilter.Seen{}, 0, err
	}
	rt, st, c, now, err := openVerify(netnsPath, gen)
	if err != nil {
		return ruleset.Drift{}, netfilter.Seen{}, 0, err
	}
	defer rt.Close()
	defer func() { _ = c.close() }()
	var d ruleset.Drift
	foreign := false
	if gen == 0 || now != gen {
		var live map[string]*liveTable
		live, foreign, err = readLive(c, PodTables, false)
		if err != nil {
			return ruleset.Drift{}, netfilter.Seen{}, 0, fmt.Errorf("read nf_tables state of netns %s: %w", netnsPath, err)
		}
		d.Items = diff(p, live, PodTables)
	}
	for _, f := range routes(st, cfg) {
		want := ruleset.PodRules(cfg, f).Routing
		rule, route, err := rt.PolicyRouteState(f, want)
		if err != nil {
			return ruleset.Drift{}, netfilter.Seen{}, 0, fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
		}
		d.Items = append(d.Items, policyroute.Drift(f, want, rule, route)...)
	}
	if cfg.StaleIPv6(st.IPv6 || st.IPv6Loopback) {
		want := ruleset.PodRules(cfg, ruleset.IPv6).Routing
		rule, route, err := rt.PolicyRouteState(ruleset.IPv6, want)
		if err != nil {
			return ruleset.Drift{}, netfilter.Seen{}, 0, fmt.Errorf("ipv6 policy routing in netns %s: %w", netnsPath, err)
		}
		d.Items = append(d.Items, policyroute.Leftover(ruleset.IPv6, want, rule, route)...)
	}
	return d, others(st, foreign), now, nil
}

// Remove deletes our tables (whatever options they were applied with) in
// one batch, then the policy routes. Idempotent, and safe when nothing is
// installed.
func (a *Applier) Remove(netnsPath string) error {
	_, err := a.remove(netnsPath, true)
	return err
}

// RemoveSeeing is Remove, also reporting what it saw of the namespace's other
// netfilter tables.
func (a *Applier) RemoveSeeing(netnsPath string) (netfilter.Seen, error) {
	return a.remove(netnsPath, true)
}

// RemoveRules deletes our tables but keeps the policy routes: for moving a
// pod to the other backend, which uses the same routes.
func (a *Applier) RemoveRules(netnsPath string) error {
	_, err := a.remove(netnsPath, false)
	return err
}

func (a *Applier) remove(netnsPath string, routing bool) (netfilter.Seen, error) {
	if err := ruleset.CheckPodNetns(netnsPath); err != nil {
		return netfilter.Seen{}, err
	}
	defer a.lock(netnsPath)()
	rt, st, c, err := open(netnsPath, true)
	if err != nil {
		return netfilter.Seen{}, err
	}
	defer rt.Close()
	tables, err := c.r.ListTablesOfFamily(gnft.TableFamilyUnspecified)
	if err != nil {
		_ = c.close()
		return netfilter.Seen{}, fmt.Errorf("list nf_tables tables in netns %s: %w", netnsPath, err)
	}
	n, foreign := 0, false
	for _, t := range tables {
		foreign = foreign || t.Family == gnft.TableFamilyIPv4 || t.Family == gnft.TableFamilyIPv6
		if t.Family == gnft.TableFamilyINet && slices.Contains(PodTables, t.Name) {
			c.q.DelTable(t)
			n++
		}
	}
	if n > 0 {
		err = c.flush()
	}
	a.release(c, n > 0)
	seen := others(st, foreign)
	if err != nil {
		return seen, fmt.Errorf("remove nf_tables rules in netns %s: %w", netnsPath, err)
	}
	if !routing {
		return seen, nil
	}
	fams := []ruleset.Family{ruleset.IPv4}
	if st.IPv6 || st.IPv6Loopback {
		fams = ruleset.Families
	}
	for _, f := range fams {
		if err := rt.RemovePolicyRoute(f, ruleset.PodRules(ruleset.PodConfig{}, f).Routing, policyroute.All); err != nil {
			return seen, fmt.Errorf("%s policy routing in netns %s: %w", f, netnsPath, err)
		}
	}
	return seen, nil
}
