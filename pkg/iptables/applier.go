package iptables

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Applier installs, verifies and removes the in-pod rule set. It holds no
// per-namespace state, so one Applier serves every pod and is safe for
// concurrent use.
type Applier struct {
	log      *slog.Logger
	backend  Backend
	exec     Executor
	router   Router
	tables   TableOwner
	sets     IPSets
	lockWait time.Duration
	timeout  time.Duration
	// stripes serialise Apply and Remove per namespace path, so two
	// callers converging the same pod cannot both add a missing jump. Two
	// pods whose paths share a stripe wait for each other, so there are
	// many: eight ADDs at once share one with a chance of about 3 %.
	stripes [1024]sync.Mutex
}

// lock takes the stripe of netnsPath and returns its unlock.
func (a *Applier) lock(netnsPath string) func() {
	h := fnv.New32a()
	_, _ = h.Write([]byte(netnsPath))
	m := &a.stripes[h.Sum32()%uint32(len(a.stripes))]
	m.Lock()
	return m.Unlock
}

// Option configures an Applier.
type Option func(*Applier)

// WithExecutor replaces the command runner (tests use a fake).
func WithExecutor(e Executor) Option { return func(a *Applier) { a.exec = e } }

// WithRouter replaces the netlink side (tests use a fake).
func WithRouter(r Router) Option { return func(a *Applier) { a.router = r } }

// TableOwner creates the nf_tables tables and base chains iptables-nft
// would create, marked as ours, and deletes them once empty
// (pkg/netfilter's CreateOwned, DeleteOwned and, in pods, DeleteInert);
// only the nft backend uses it.
type TableOwner interface {
	CreateOwned(netnsPath string, tables []netfilter.TableRef, chains []netfilter.BaseChain) (netfilter.Created, error)
	DeleteOwned(netnsPath string, tables []netfilter.TableRef) (netfilter.Created, error)
	DeleteInert(netnsPath string, tables []netfilter.TableRef) (netfilter.Created, error)
}

// WithTableOwner replaces the nf_tables table side (tests use a fake).
func WithTableOwner(t TableOwner) Option { return func(a *Applier) { a.tables = t } }

// WithLockWait sets how long iptables-restore waits for the xtables lock
// (legacy takes a host-wide lock even for other namespaces). Default 10s.
func WithLockWait(d time.Duration) Option { return func(a *Applier) { a.lockWait = d } }

// WithTimeout bounds each Apply, Verify or Remove that has no deadline of
// its own. Default 60s.
func WithTimeout(d time.Duration) Option { return func(a *Applier) { a.timeout = d } }

// NewApplier returns an Applier using backend b for every namespace.
func NewApplier(log *slog.Logger, b Backend, opts ...Option) *Applier {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Applier{
		log:      log.With("component", "iptables", "backend", string(b)),
		backend:  b,
		exec:     NetnsExecutor{},
		router:   NetlinkRouter{},
		tables:   &netfilter.Owner{},
		sets:     NetlinkIPSets{},
		lockWait: 10 * time.Second,
		timeout:  60 * time.Second,
	}
	for _, o := range opts {
		o(a)
	}
	return a
}

// Close waits for netlink connections the Applier closes in the
// background (see netfilter.Owner).
func (a *Applier) Close() error {
	if c, ok := a.tables.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// Backend returns the backend the Applier drives.
func (a *Applier) Backend() Backend { return a.backend }

func (a *Applier) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || a.timeout <= 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, a.timeout)
}

// save reads and parses the family's current state in the namespace.
func (a *Applier) save(ctx context.Context, netnsPath string, f ruleset.Family) (*Save, error) {
	out, err := a.exec.Run(ctx, netnsPath, Cmd{Name: a.backend.SaveCmd(f)})
	if err != nil {
		return nil, fmt.Errorf("read %s rules in netns %s: %w", f, netnsPath, err)
	}
	s, err := ParseSave(string(out))
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", a.backend.SaveCmd(f), err)
	}
	return s, nil
}

// restore feeds plan to iptables-restore --noflush: one transaction.
func (a *Applier) restore(ctx context.Context, netnsPath string, f ruleset.Family, plan string) error {
	args := []string{"--noflush"}
	if a.lockWait > 0 {
		args = append(args, "-w", strconv.Itoa(max(1, int(a.lockWait/time.Second))))
	}
	_, err := a.exec.Run(ctx, netnsPath, Cmd{Name: a.backend.RestoreCmd(f), Args: args, Stdin: []byte(plan)})
	if err != nil {
		a.log.Debug("iptables-restore failed", "netns", netnsPath, "family", f.String(), "input", plan)
		return fmt.Errorf("apply %s rules in netns %s: %w", f, netnsPath, err)
	}
	return nil
}

// nftTable names the nf_tables table iptables-nft uses for table t.
func nftTable(f ruleset.Family, t string) netfilter.TableRef {
	if f == ruleset.IPv6 {
		return netfilter.TableRef{Family: netfilter.FamilyIPv6, Name: t}
	}
	return netfilter.TableRef{Family: netfilter.FamilyIPv4, Name: t}
}

// each runs fn for every plan at once (the families share nothing, and each
// costs a few process executions) and joins the errors.
func each(plans []*familyPlan, fn func(*familyPlan) error) error {
	errs := make([]error, len(plans))
	var wg sync.WaitGroup
	for i, p := range plans {
		wg.Go(func() { errs[i] = fn(p) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// perFamily runs fn for both families at once and joins their errors.
func perFamily(fn func(ruleset.Family) error) error {
	plans := make([]*familyPlan, len(ruleset.Families))
	for i, f := range ruleset.Families {
		plans[i] = &familyPlan{f: f}
	}
	return each(plans, func(p *familyPlan) error { return fn(p.f) })
}
