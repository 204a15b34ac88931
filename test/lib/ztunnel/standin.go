// Package ztunnel is a ztunnel stand-in for the end-to-end tests and the
// local sandbox. It
// speaks ZDS to the node agent exactly as the compatibility spec describes
// (hello, snapshot, one ack per request, protocol errors that hang up) and,
// for every pod it is handed, opens real listeners inside the pod's network
// namespace on 15001 (outbound), 15006 (inbound plaintext), 15008
// (tunnel) and 15053 (DNS, TCP only, answering nothing), proxies the
// traffic with ztunnel's mark, and records every connection so tests can
// see which way it went.
//
// The tunnel between pods is shaped like HBONE (an HTTP/2 CONNECT stream
// to the destination pod's 15008, without mTLS); 15008 also takes a plain
// "CONNECT ip:port\n" header.
// Faults makes it misbehave on purpose.
package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/zdspb"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// Config configures a StandIn. Zero values take defaults.
type Config struct {
	// SocketPath is the agent's ZDS socket (default ambient.DefaultZDSSocket).
	SocketPath string
	// MinBackoff and MaxBackoff bound the reconnect back-off (default
	// 50ms and 2s); it doubles after each failed attempt.
	MinBackoff, MaxBackoff time.Duration
	// DialTimeout bounds each upstream dial (default 5s).
	DialTimeout time.Duration
	// Logger receives structured logs (default: discarded).
	Logger *slog.Logger
}

// Faults make the stand-in misbehave; the zero value behaves.
type Faults struct {
	NoHello  bool          // connect but never send the hello
	NeverAck bool          // act on requests but never answer
	AckTwice bool          // answer every request twice
	Garbage  bool          // answer with bytes that are not a WorkloadResponse
	AckDelay time.Duration // wait this long before each answer
	// RejectAdd, when it returns non-empty text for a uid, acks that Add
	// with the text as error instead of serving the pod.
	RejectAdd func(uid string) string
	// Deaf, when it returns true for a uid, acks that Add and serves the
	// pod without opening its in-pod listeners: a ztunnel that lost a pod
	// for good, whose Del and Add do not bring the listeners back.
	Deaf func(uid string) bool
}

// NetnsID identifies a network namespace (nsfs device and inode).
type NetnsID struct{ Dev, Ino uint64 }

// WorkloadInfo is the pod identity ztunnel received.
type WorkloadInfo struct{ Name, Namespace, ServiceAccount string }

// Workload is a pod the stand-in currently serves.
type Workload struct {
	UID   string
	Info  WorkloadInfo
	Netns NetnsID
	IPs   []netip.Addr // global unicast addresses found in the pod's netns
	Ports []int        // in-pod listening ports, one entry per listener
}

// Message kinds, as recorded in Message.Kind.
const (
	KindAdd          = "add"
	KindKeep         = "keep"
	KindDel          = "del"
	KindSnapshotSent = "snapshot_sent"
	KindInvalid      = "invalid"
)

// Message is one ZDS request the stand-in received and how it answered.
type Message struct {
	Conn     int // 1 for the first connection, 2 after the first reconnect, ...
	Kind     string
	UID      string
	Info     *WorkloadInfo // Adds only
	FDs      int           // descriptors attached
	Netns    NetnsID       // Adds whose descriptor is a network namespace
	AckError string        // the error it acked with ("" = success)
	TornDown bool          // it hung up because of this message
}

// Record is one connection the stand-in proxied.
type Record struct {
	UID      string         // the pod whose listener accepted it
	Port     int            // 15001, 15006, 15008 or 15053
	Source   netip.AddrPort // the peer of the accepted connection
	OrigDst  netip.AddrPort // original destination (15001/15006) or tunnel target (15008)
	Upstream netip.AddrPort // where the stand-in dialed
	Tunneled bool           // 15001 only: went to the destination pod's 15008
	Err      string         // why it was not proxied, if it was not
}

// StandIn is one ztunnel stand-in instance.
type StandIn struct {
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	faults   Faults
	pods     map[string]*pod
	byIP     map[netip.Addr]string
	remote   map[netip.Addr]bool
	records  []Record
	messages []Message
	connSeq  int
	cur      *net.UnixConn
	ready    bool
	running  bool
	changed  chan struct{}
}

// New returns a stand-in; Run connects it.
func New(cfg Config) *StandIn {
	if cfg.SocketPath == "" {
		cfg.SocketPath = ambient.DefaultZDSSocket
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 50 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(2*time.Second, cfg.MinBackoff)
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &StandIn{
		cfg:     cfg,
		log:     cfg.Logger,
		pods:    map[string]*pod{},
		byIP:    map[netip.Addr]string{},
		changed: make(chan struct{}),
	}
}

// SetFaults changes how the stand-in (mis)behaves from the next message on.
func (z *StandIn) SetFaults(f Faults) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.faults = f
}

// Run connects to the agent and reconnects with back-off until ctx ends;
// then it closes every listener and pod netns it holds and returns.
// Workloads survive reconnects, as in ztunnel, until a snapshot drops them.
func (z *StandIn) Run(ctx context.Context) error {
	z.mu.Lock()
	if z.running {
		z.mu.Unlock()
		return errors.New("stand-in already running")
	}
	z.running = true
	z.mu.Unlock()
	defer func() {
		z.mu.Lock()
		pods := z.pods
		z.pods, z.byIP = map[string]*pod{}, map[netip.Addr]string{}
		z.running = false
		z.notifyLocked()
		z.mu.Unlock()
		for _, p := range pods {
			p.stop()
		}
	}()

	backoff := z.cfg.MinBackoff
	for ctx.Err() == nil {
		wasReady, err := z.session(ctx)
		if ctx.Err() != nil {
			break
		}
		if wasReady {
			backoff = z.cfg.MinBackoff
		}
		z.log.Info("stand-in disconnected, reconnecting", "err", err, "in", backoff)
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		backoff = min(2*backoff, z.cfg.MaxBackoff)
	}
	return nil
}

// Disconnect drops the current connection as a ztunnel losing the agent
// would, keeping its workloads; Run reconnects.
func (z *StandIn) Disconnect() {
	z.mu.Lock()
	defer z.mu.Unlock()
	if z.cur != nil {
		_ = z.cur.Close()
	}
}

// Ready reports whether the current connection's snapshot is complete.
func (z *StandIn) Ready() bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.ready
}

// Connections is how many connections the stand-in has made so far.
func (z *StandIn) Connections() int {
	z.mu.Lock()
	defer z.mu.Unlock()
	return z.connSeq
}

// Messages returns every ZDS request received so far, in order.
func (z *StandIn) Messages() []Message {
	z.mu.Lock()
	defer z.mu.Unlock()
	return slices.Clone(z.messages)
}

// Records returns every proxied connection so far, in order.
func (z *StandIn) Records() []Record {
	z.mu.Lock()
	defer z.mu.Unlock()
	return slices.Clone(z.records)
}

// Workloads returns the pods currently served, sorted by uid.
func (z *StandIn) Workloads() []Workload {
	z.mu.Lock()
	defer z.mu.Unlock()
	out := make([]Workload, 0, len(z.pods))
	for _, p := range z.pods {
		out = append(out, p.view())
	}
	slices.SortFunc(out, func(a, b Workload) int { return strings.Compare(a.UID, b.UID) })
	return out
}

// Workload returns one served pod.
func (z *StandIn) Workload(uid string) (Workload, bool) {
	z.mu.Lock()
	defer z.mu.Unlock()
	p, ok := z.pods[uid]
	if !ok {
		return Workload{}, false
	}
	return p.view(), true
}

// CloseListeners closes the in-pod listeners of one served pod and keeps
// serving it otherwise, as a ztunnel that lost a pod's listeners but not
// the pod: an Add of the pod in the same netns then changes nothing (a Del
// and a new Add start it again). False when the pod is not served.
func (z *StandIn) CloseListeners(uid string) bool {
	z.mu.Lock()
	p, ok := z.pods[uid]
	z.mu.Unlock()
	if !ok {
		return false
	}
	p.mu.Lock()
	for _, l := range p.lns {
		_ = l.Close()
	}
	p.lns = nil
	p.mu.Unlock()
	z.mu.Lock()
	z.notifyLocked()
	z.mu.Unlock()
	return true
}

// Wait blocks until cond returns true or ctx ends. cond is re-evaluated
// whenever the stand-in's state changes; it may call the accessors.
func (z *StandIn) Wait(ctx context.Context, cond func() bool) error {
	for {
		z.mu.Lock()
		ch := z.changed
		z.mu.Unlock()
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (z *StandIn) notifyLocked() {
	close(z.changed)
	z.changed = make(chan struct{})
}

// session is one connection: hello, then request/ack until it ends.
func (z *StandIn) session(ctx context.Context) (wasReady bool, err error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", z.cfg.SocketPath)
	if err != nil {
		return false, fmt.Errorf("connect %s: %w", z.cfg.SocketPath, err)
	}
	uc := c.(*net.UnixConn)
	z.mu.Lock()
	z.connSeq++
	id := z.connSeq
	z.cur, z.ready = uc, false
	faults := z.faults
	z.notifyLocked()
	z.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { _ = uc.Close() })
	defer func() {
		stop()
		_ = uc.Close()
		z.mu.Lock()
		if z.cur == uc {
			z.cur, z.ready = nil, false
		}
		z.notifyLocked()
		z.mu.Unlock()
	}()
	log := z.log.With("conn", id)

	if !faults.NoHello {
		b, _ := proto.Marshal(&zdspb.ZdsHello{Version: zdspb.Version_V1})
		if err := writeDatagram(uc, b); err != nil {
			return false, fmt.Errorf("send hello: %w", err)
		}
	}
	snapshotDone := false
	seen := map[string]bool{}
	buf := make([]byte, readBufferSize)
	oob := make([]byte, unix.CmsgSpace(4*8))
	for {
		n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
		fds := parseRights(oob[:oobn])
		if err != nil || n == 0 {
			closeFDs(fds)
			if err == nil {
				err = io.EOF
			}
			return snapshotDone, err
		}
		req, v, why := judge(buf[:n], len(fds), snapshotDone)
		if flags&unix.MSG_TRUNC != 0 {
			v, why = teardown, "message does not fit the 1024-byte buffer"
		} else if flags&unix.MSG_CTRUNC != 0 && v == accept {
			v, why = reject, "too many descriptors"
		}
		m := Message{Conn: id, Kind: kindOf(req), UID: uidOf(req), FDs: len(fds)}
		if a := req.GetAdd(); a != nil && a.GetWorkloadInfo() != nil {
			wi := a.GetWorkloadInfo()
			m.Info = &WorkloadInfo{Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()}
		}
		if m.Kind == KindAdd && len(fds) == 1 {
			m.Netns, _ = netnsID(fds[0])
		}
		switch v {
		case accept:
			m.AckError = z.apply(log, req, fds, seen, &snapshotDone)
		default:
			closeFDs(fds)
			m.AckError, m.TornDown = why, v == teardown
			log.Warn("stand-in refusing request", "kind", m.Kind, "uid", m.UID, "why", why, "teardown", m.TornDown)
		}
		z.mu.Lock()
		z.messages = append(z.messages, m)
		if snapshotDone && z.cur == uc {
			z.ready = true
		}
		faults = z.faults
		z.notifyLocked()
		z.mu.Unlock()

		if err := answer(uc, m.AckError, faults); err != nil {
			return snapshotDone, fmt.Errorf("answer: %w", err)
		}
		if m.TornDown {
			return snapshotDone, fmt.Errorf("protocol error: %s", why)
		}
	}
}

// apply acts on an accepted request and returns the ack's error text.
// It owns fds.
func (z *StandIn) apply(log *slog.Logger, req *zdspb.WorkloadRequest, fds []int, seen map[string]bool, snapshotDone *bool) string {
	switch p := req.Payload.(type) {
	case *zdspb.WorkloadRequest_Add:
		uid := p.Add.GetUid()
		seen[uid] = true
		return z.add(log, uid, p.Add.GetWorkloadInfo(), fds[0])
	case *zdspb.WorkloadRequest_Keep:
		seen[p.Keep.GetUid()] = true
	case *zdspb.WorkloadRequest_Del:
		z.remove(p.Del.GetUid())
		log.Info("stand-in removed workload", "uid", p.Del.GetUid())
	case *zdspb.WorkloadRequest_SnapshotSent:
		*snapshotDone = true
		z.mu.Lock()
		var drop []string
		for uid := range z.pods {
			if !seen[uid] {
				drop = append(drop, uid)
			}
		}
		z.mu.Unlock()
		for _, uid := range drop {
			z.remove(uid)
		}
		log.Info("stand-in snapshot complete", "named", len(seen), "dropped", len(drop))
	}
	return ""
}

func (z *StandIn) add(log *slog.Logger, uid string, wi *zdspb.WorkloadInfo, fd int) string {
	id, err := netnsID(fd)
	if err != nil {
		_ = unix.Close(fd)
		return err.Error()
	}
	z.mu.Lock()
	old := z.pods[uid]
	reject, deaf := z.faults.RejectAdd, z.faults.Deaf
	z.mu.Unlock()
	if old != nil && old.ns == id {
		_ = unix.Close(fd) // same pod, same netns: nothing to do
		return ""
	}
	if reject != nil {
		if msg := reject(uid); msg != "" {
			_ = unix.Close(fd)
			return msg
		}
	}
	info := WorkloadInfo{Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()}
	p, err := z.startPod(uid, info, fd, id, deaf == nil || !deaf(uid))
	if err != nil {
		return fmt.Sprintf("serve pod %s: %v", uid, err)
	}
	z.mu.Lock()
	old = z.pods[uid]
	z.pods[uid] = p
	z.reindexLocked()
	z.notifyLocked()
	z.mu.Unlock()
	if old != nil {
		old.stop()
	}
	log.Info("stand-in serving workload", "uid", uid, "ips", p.ips, "replaced", old != nil)
	return ""
}

func (z *StandIn) remove(uid string) {
	z.mu.Lock()
	p := z.pods[uid]
	delete(z.pods, uid)
	z.reindexLocked()
	z.notifyLocked()
	z.mu.Unlock()
	if p != nil {
		p.stop()
	}
}

func (z *StandIn) reindexLocked() {
	z.byIP = map[netip.Addr]string{}
	for uid, p := range z.pods {
		for _, ip := range p.ips {
			z.byIP[ip] = uid
		}
	}
}

// SetRemote names the captured pods other nodes' ztunnels serve: a
// connection to one of them is tunneled to its 15008 across the nodes, as
// ztunnel does for an HBONE workload istiod tells it about.
func (z *StandIn) SetRemote(addrs []netip.Addr) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.remote = map[netip.Addr]bool{}
	for _, a := range addrs {
		z.remote[a.Unmap()] = true
	}
}

// inMesh reports whether a destination takes the tunnel: a pod this
// stand-in or another node's serves.
func (z *StandIn) inMesh(a netip.Addr) bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	_, ok := z.byIP[a.Unmap()]
	return ok || z.remote[a.Unmap()]
}

func (z *StandIn) record(r Record) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.records = append(z.records, r)
	z.notifyLocked()
}

func kindOf(req *zdspb.WorkloadRequest) string {
	switch req.GetPayload().(type) {
	case *zdspb.WorkloadRequest_Add:
		return KindAdd
	case *zdspb.WorkloadRequest_Keep:
		return KindKeep
	case *zdspb.WorkloadRequest_Del:
		return KindDel
	case *zdspb.WorkloadRequest_SnapshotSent:
		return KindSnapshotSent
	}
	return KindInvalid
}

func uidOf(req *zdspb.WorkloadRequest) string {
	switch {
	case req.GetAdd() != nil:
		return req.GetAdd().GetUid()
	case req.GetKeep() != nil:
		return req.GetKeep().GetUid()
	case req.GetDel() != nil:
		return req.GetDel().GetUid()
	}
	return ""
}

// answer sends the ack for one request, as the faults dictate.
func answer(uc *net.UnixConn, ackErr string, f Faults) error {
	if f.AckDelay > 0 {
		time.Sleep(f.AckDelay)
	}
	switch {
	case f.NeverAck:
		return nil
	case f.Garbage:
		return writeDatagram(uc, []byte{0xff, 0xff, 0xff, 0xff, 0x07})
	}
	b, err := proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: ackErr}}})
	if err != nil {
		return err
	}
	if len(b) > readBufferSize-1 { // keep long error texts within the agent's limit
		b, _ = proto.Marshal(&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: ackErr[:512]}}})
	}
	if err := writeDatagram(uc, b); err != nil {
		return err
	}
	if f.AckTwice {
		return writeDatagram(uc, b)
	}
	return nil
}

func writeDatagram(uc *net.UnixConn, b []byte) error {
	if err := uc.SetWriteDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return err
	}
	_, err := uc.Write(b)
	return err
}

func parseRights(oob []byte) []int {
	if len(oob) == 0 {
		return nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for _, m := range msgs {
		if f, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}
