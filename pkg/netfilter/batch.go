package netfilter

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"
	"unsafe"

	gnft "github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// An nf_tables transaction asks the kernel for one acknowledgement, on its
// last message. The kernel processes the whole batch first, then answers:
// an error for every message that failed (acked or not) and an ack for
// every message that asked, in message order, so the last message's answer
// is the last one. A batch refused as a whole (no permission, malformed)
// gets one error, on its BATCH_BEGIN. Reading the answers is then a plain
// recv loop on one socket, instead of a receive per message.

// Batch is one encoded nf_tables transaction: BATCH_BEGIN, the messages
// and BATCH_END, with only the last message asking for an ack. It is
// immutable once built, so one Batch can be sent any number of times, from
// any goroutine, on different sockets: Send renumbers a copy.
type Batch struct {
	buf   []byte   // the encoded batch, sequence numbers left 0
	offs  []int    // offset of every header in buf, BATCH_BEGIN first
	types []uint16 // every message's netlink type, as offs
}

// Len is the number of messages between BATCH_BEGIN and BATCH_END.
func (b *Batch) Len() int { return max(len(b.offs)-2, 0) }

// Bytes returns the encoded batch with sequence numbers starting at first,
// for tests and replay comparison.
func (b *Batch) Bytes(first uint32) []byte {
	out := append([]byte(nil), b.buf...)
	b.number(out, first)
	return out
}

func (b *Batch) number(buf []byte, first uint32) {
	for i, off := range b.offs {
		binary.NativeEndian.PutUint32(buf[off+8:], first+uint32(i))
	}
}

// nlmsghdr is the size of struct nlmsghdr.
const nlmsghdr = unix.SizeofNlMsghdr

// NewBatch encodes msgs (nf_tables requests, as google/nftables or rawMsg
// build them, without BATCH_BEGIN and BATCH_END) as one transaction. The
// messages keep their type and payload; their ack and echo flags are
// cleared, and the last one asks for the ack.
func NewBatch(msgs []netlink.Message) (*Batch, error) {
	b := &Batch{}
	put := func(typ uint16, flags netlink.HeaderFlags, data []byte) {
		off := len(b.buf)
		n := nlmsghdr + len(data)
		var h [nlmsghdr]byte
		binary.NativeEndian.PutUint32(h[0:], uint32(n))
		binary.NativeEndian.PutUint16(h[4:], typ)
		binary.NativeEndian.PutUint16(h[6:], uint16(flags))
		// Sequence number (8:12) set at send; port id (12:16) 0: the
		// kernel ignores it in requests.
		b.buf = append(b.buf, h[:]...)
		b.buf = append(b.buf, data...)
		for len(b.buf)%4 != 0 {
			b.buf = append(b.buf, 0)
		}
		b.offs = append(b.offs, off)
		b.types = append(b.types, typ)
	}
	ctl := genmsg(unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES)
	put(unix.NFNL_MSG_BATCH_BEGIN, netlink.Request, ctl)
	for i, m := range msgs {
		if m.Header.Type>>8 != unix.NFNL_SUBSYS_NFTABLES {
			return nil, fmt.Errorf("nf_tables batch: message %d has type %#x, not an nf_tables request", i, uint16(m.Header.Type))
		}
		if len(m.Data) > 1<<20 {
			return nil, fmt.Errorf("nf_tables batch: message %d is %d bytes", i, len(m.Data))
		}
		flags := m.Header.Flags&^(netlink.Acknowledge|netlink.Echo) | netlink.Request
		if i == len(msgs)-1 {
			flags |= netlink.Acknowledge
		}
		put(uint16(m.Header.Type), flags, m.Data)
	}
	put(unix.NFNL_MSG_BATCH_END, netlink.Request, ctl)
	return b, nil
}

// Recorder is a google/nftables connection that sends nothing: what its
// Flush would send is kept, and Batch returns it as one transaction. It
// only queues (Add*, Del*, SetAddElements...); reads need a real
// connection. The messages are google/nftables' own, byte for byte.
type Recorder struct {
	*gnft.Conn
	msgs []netlink.Message
}

// NewRecorder returns an empty Recorder.
func NewRecorder() (*Recorder, error) {
	r := &Recorder{}
	// Lasting: one in-memory connection for every Flush.
	c, err := gnft.New(gnft.AsLasting(), gnft.WithTestDial(func(req []netlink.Message) ([]netlink.Message, error) {
		r.msgs = append(r.msgs, req...)
		// No answers: Flush returns at once.
		return nil, io.EOF
	}))
	if err != nil {
		return nil, fmt.Errorf("nf_tables recorder: %w", err)
	}
	r.Conn = c
	return r, nil
}

// Batch returns what was queued since the last call as one Batch (empty
// when nothing was) and empties the Recorder.
func (r *Recorder) Batch() (*Batch, error) {
	r.msgs = r.msgs[:0]
	if err := r.Conn.Flush(); err != nil {
		return nil, fmt.Errorf("nf_tables recorder: %w", err)
	}
	if len(r.msgs) < 2 {
		return &Batch{}, nil
	}
	// google/nftables framed the messages with BATCH_BEGIN and BATCH_END.
	return NewBatch(r.msgs[1 : len(r.msgs)-1])
}

// Socket is a NETLINK_NETFILTER socket for sending batches, opened in the
// network namespace of the calling thread and usable from any thread
// afterwards. It is not safe for concurrent use.
type Socket struct {
	fd int
	// rc, when set, is a mdlayher/netlink connection's socket, owned and
	// closed by that connection; fd is then unused.
	rc   syscall.RawConn
	seq  uint32
	out  []byte
	recv []byte
}

// socketOf sends batches on c's socket (non-blocking, in Go's poller; c's
// read deadline bounds the wait for answers). Its sequence numbers start
// far from c's own, so a late answer is never taken for one of c's.
func socketOf(c *netlink.Conn) (*Socket, error) {
	if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
		return nil, fmt.Errorf("netlink (netfilter) socket: NETLINK_CAP_ACK: %w", err)
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("netlink (netfilter) socket: %w", err)
	}
	return &Socket{fd: -1, rc: rc, seq: 1 << 31}, nil
}

// answerBuf is the receive buffer. Answers are capped (NETLINK_CAP_ACK):
// an error carries the failed message's header, not its payload, plus the
// kernel's short explanation.
const answerBuf = 8192

// DialSocket opens a Socket in the calling thread's network namespace.
// Answers to a batch that never come (the kernel dropped them) are waited
// for at most batchAckWait.
func DialSocket() (*Socket, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("netlink (netfilter) socket: %w", err)
	}
	tv := unix.NsecToTimeval(batchAckWait.Nanoseconds())
	for _, step := range []struct {
		what string
		do   func() error
	}{
		{"bind", func() error { return unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}) }},
		{"NETLINK_CAP_ACK", func() error { return unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1) }},
		{"NETLINK_EXT_ACK", func() error { return unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1) }},
		{"SO_RCVTIMEO", func() error { return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv) }},
	} {
		if err := step.do(); err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("netlink (netfilter) socket: %s: %w", step.what, err)
		}
	}
	return &Socket{fd: fd}, nil
}

// Close closes the socket.
func (s *Socket) Close() error {
	if s == nil || s.fd < 0 || s.rc != nil {
		return nil
	}
	err := unix.Close(s.fd)
	s.fd = -1
	return err
}

// Send sends b as one transaction and waits for the kernel's answer: nil
// when it committed, else an error per failed message (which message, its
// type, errno and the kernel's explanation); the kernel then applied
// nothing.
func (s *Socket) Send(b *Batch) error {
	if b.Len() == 0 {
		return nil
	}
	first := s.seq + 1
	s.seq += uint32(len(b.offs))
	s.out = append(s.out[:0], b.buf...)
	b.number(s.out, first)
	n, err := s.write(s.out)
	if err != nil {
		return fmt.Errorf("send nf_tables batch: %w", err)
	}
	if n != len(s.out) {
		return fmt.Errorf("send nf_tables batch: sent %d of %d bytes", n, len(s.out))
	}
	if s.recv == nil {
		s.recv = make([]byte, answerBuf)
	}
	w := answers{first: first, last: first + uint32(len(b.offs)) - 2, types: b.types}
	for !w.done {
		n, err := s.read()
		if err != nil {
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, os.ErrDeadlineExceeded) {
				err = fmt.Errorf("no answer within %s", batchAckWait)
			}
			return w.fail(fmt.Errorf("receive nf_tables answers: %w", err))
		}
		if n > len(s.recv) {
			return w.fail(fmt.Errorf("receive nf_tables answers: %d-byte datagram exceeds %d", n, len(s.recv)))
		}
		if err := w.parse(s.recv[:n]); err != nil {
			return w.fail(err)
		}
	}
	return w.fail(nil)
}

func (s *Socket) write(b []byte) (int, error) {
	if s.rc == nil {
		return unix.Write(s.fd, b)
	}
	var n int
	var err error
	if cerr := s.rc.Write(func(fd uintptr) bool {
		n, err = unix.Write(int(fd), b)
		return err != unix.EAGAIN
	}); cerr != nil {
		return 0, cerr
	}
	return n, err
}

func (s *Socket) read() (int, error) {
	if s.rc == nil {
		return recvTrunc(s.fd, s.recv)
	}
	var n int
	var err error
	if cerr := s.rc.Read(func(fd uintptr) bool {
		n, err = recvTrunc(int(fd), s.recv)
		return err != unix.EAGAIN
	}); cerr != nil {
		return 0, cerr
	}
	return n, err
}

// recvTrunc reads one datagram into buf; with MSG_TRUNC the kernel
// reports its full length even when it did not fit. A raw recvfrom
// without a source address, so the hot path allocates nothing.
func recvTrunc(fd int, buf []byte) (int, error) {
	for {
		n, _, e := unix.Syscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), unix.MSG_TRUNC, 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(n), nil
	}
}

// MessageError is the kernel's refusal of one message of a batch.
type MessageError struct {
	// Index is the message's position in the batch (0 = the first after
	// BATCH_BEGIN); -1 means BATCH_BEGIN: the kernel refused the batch
	// as a whole.
	Index int
	// Type is the message's nf_tables type (NFT_MSG_*), 0 for the batch.
	Type uint16
	// Errno is what the kernel answered.
	Errno unix.Errno
	// Msg is the kernel's extended explanation, when it gave one.
	Msg string
}

func (e *MessageError) Error() string {
	where := "batch refused"
	if e.Index >= 0 {
		where = fmt.Sprintf("message %d (%s)", e.Index, msgName(e.Type))
	}
	if e.Msg != "" {
		return fmt.Sprintf("%s: %v (%s)", where, e.Errno, e.Msg)
	}
	return fmt.Sprintf("%s: %v", where, e.Errno)
}

// Unwrap lets errors.Is match the errno.
func (e *MessageError) Unwrap() error { return e.Errno }

var msgNames = map[uint16]string{
	unix.NFT_MSG_NEWTABLE: "NEWTABLE", unix.NFT_MSG_DELTABLE: "DELTABLE",
	unix.NFT_MSG_NEWCHAIN: "NEWCHAIN", unix.NFT_MSG_DELCHAIN: "DELCHAIN",
	unix.NFT_MSG_NEWRULE: "NEWRULE", unix.NFT_MSG_DELRULE: "DELRULE",
	unix.NFT_MSG_NEWSET: "NEWSET", unix.NFT_MSG_DELSET: "DELSET",
	unix.NFT_MSG_NEWSETELEM: "NEWSETELEM", unix.NFT_MSG_DELSETELEM: "DELSETELEM",
}

func msgName(t uint16) string {
	if n, ok := msgNames[t&0xff]; ok {
		return n
	}
	return fmt.Sprintf("type %#x", t)
}

// answers collects the kernel's answers to one batch sent with sequence
// numbers first (BATCH_BEGIN) .. last (the acked message); BATCH_END
// (last+1) is never answered.
type answers struct {
	first, last uint32
	types       []uint16
	errs        []error
	done        bool
}

func (w *answers) fail(err error) error {
	if err != nil {
		w.errs = append(w.errs, err)
	}
	if len(w.errs) == 0 {
		return nil
	}
	return fmt.Errorf("nf_tables batch: %w", errors.Join(w.errs...))
}

// nlmsgerr is struct nlmsgerr with a capped embedded header: errno, then
// the request's nlmsghdr.
const nlmsgerr = 4 + nlmsghdr

// Flags of an NLMSG_ERROR answer.
const (
	nlmFCapped  = 0x100 // NLM_F_CAPPED: the request's payload is left out
	nlmFAckTLVs = 0x200 // NLM_F_ACK_TLVS: extended ack attributes follow
)

// parse reads one datagram of answers. Anything not an answer to this
// batch (another sequence number, a notification) is skipped; a
// malformed datagram is an error.
func (w *answers) parse(b []byte) error {
	for len(b) > 0 {
		if len(b) < nlmsghdr {
			return fmt.Errorf("nf_tables answer: %d trailing bytes", len(b))
		}
		n := int(binary.NativeEndian.Uint32(b[0:]))
		if n < nlmsghdr || n > len(b) {
			return fmt.Errorf("nf_tables answer: length %d in a %d-byte datagram", n, len(b))
		}
		typ := binary.NativeEndian.Uint16(b[4:])
		flags := binary.NativeEndian.Uint16(b[6:])
		seq := binary.NativeEndian.Uint32(b[8:])
		msg := b[nlmsghdr:n]
		adv := (n + 3) &^ 3
		if adv > len(b) {
			adv = len(b)
		}
		b = b[adv:]
		// Offsets from first, so a counter that wraps inside the batch
		// still matches.
		if typ != unix.NLMSG_ERROR || seq-w.first > w.last-w.first {
			continue
		}
		if len(msg) < nlmsgerr {
			return fmt.Errorf("nf_tables answer: %d-byte error", len(msg))
		}
		errno := -int32(binary.NativeEndian.Uint32(msg[0:]))
		if errno < 0 {
			return fmt.Errorf("nf_tables answer: errno %d", -errno)
		}
		if errno == 0 {
			if seq == w.last {
				w.done = true
			}
			continue
		}
		e := &MessageError{Index: int(seq-w.first) - 1, Errno: unix.Errno(errno)}
		if e.Index >= 0 {
			e.Type = w.types[e.Index+1] & 0xff
		}
		if flags&nlmFAckTLVs != 0 {
			rest := msg[4:]
			if flags&nlmFCapped == 0 {
				// The request came back whole; skip it.
				inner := int(binary.NativeEndian.Uint32(rest[0:]))
				if inner < nlmsghdr || inner > len(rest) {
					return fmt.Errorf("nf_tables answer: embedded length %d in %d bytes", inner, len(rest))
				}
				rest = rest[(min(inner+3, len(rest)))&^3:]
			} else {
				rest = rest[nlmsghdr:]
			}
			e.Msg = ackMsg(rest)
		}
		w.errs = append(w.errs, e)
		if seq == w.last || seq == w.first {
			w.done = true
		}
	}
	return nil
}

// maxAckMsg bounds the kernel's explanation kept in an error.
const maxAckMsg = 256

// ackMsg returns NLMSGERR_ATTR_MSG from extended ack attributes, or "".
func ackMsg(b []byte) string {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return ""
	}
	for ad.Next() {
		if ad.Type() == unix.NLMSGERR_ATTR_MSG {
			s := ad.String()
			if len(s) > maxAckMsg {
				s = s[:maxAckMsg]
			}
			return s
		}
	}
	return ""
}

// batchAckWait bounds the wait for a batch's acknowledgements.
const batchAckWait = 10 * time.Second
