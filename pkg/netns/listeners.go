package netns

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"

	"golang.org/x/sys/unix"
)

// ListeningTCPPorts lists the local ports of the TCP sockets listening in
// the open network namespace ns, IPv4 and IPv6 alike, with one socket
// diagnostics (NETLINK_SOCK_DIAG, inet_diag) dump per family. The netlink
// socket is opened inside ns, so the kernel answers for that namespace
// only; nothing else runs there.
func ListeningTCPPorts(ns *os.File) (map[uint16]bool, error) {
	out := map[uint16]bool{}
	err := doFD(int(ns.Fd()), ns.Name(), func() error {
		fd, err := diagSocket()
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		return dumpBoth(fd, 0, out)
	})
	if err != nil {
		return nil, fmt.Errorf("list listening TCP sockets in netns %s: %w", ns.Name(), err)
	}
	return out, nil
}

// TCPListening reports which of ports have a TCP socket listening on them
// in the open network namespace ns, on any address, IPv4 or IPv6: what
// ListeningTCPPorts would say of them, at a cost that does not grow with
// the node. A dump walks the host's whole listening hash (every
// namespace's listeners, tens of thousands of buckets) to return this
// namespace's few; an exact inet_diag request (no NLM_F_DUMP) is the
// kernel's own lookup of an incoming connection, one hash bucket. Each
// port is looked up as a connection to 127.0.0.1 would find it (a
// wildcard or loopback listener, IPv4 or dual-stack), then to ::1; only
// when a port is found neither way (a listener bound to another address
// or a device, or none: drift) does it dump, so the answer is the dump's.
// The namespace is entered once.
func TCPListening(ns *os.File, ports []uint16) (map[uint16]bool, error) {
	var out map[uint16]bool
	err := doFD(int(ns.Fd()), ns.Name(), func() error {
		var err error
		out, err = tcpListeningHere(ports)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("look up listening TCP sockets in netns %s: %w", ns.Name(), err)
	}
	return out, nil
}

// AddrsAndTCPListening is Addrs and TCPListening of ns at once, entering
// it once: the verifier's look into a pod's namespace, made once per pod
// a period.
func AddrsAndTCPListening(ns *os.File, ports []uint16) ([]netip.Addr, map[uint16]bool, error) {
	var (
		addrs []netip.Addr
		out   map[uint16]bool
	)
	err := doFD(int(ns.Fd()), ns.Name(), func() error {
		var err error
		if addrs, err = addrsHere(); err != nil {
			return err
		}
		out, err = tcpListeningHere(ports)
		return err
	})
	if err != nil {
		return nil, nil, fmt.Errorf("read addresses and listening TCP sockets in netns %s: %w", ns.Name(), err)
	}
	return addrs, out, nil
}

// tcpListeningHere is TCPListening in the calling thread's namespace.
func tcpListeningHere(ports []uint16) (map[uint16]bool, error) {
	out := make(map[uint16]bool, len(ports))
	if len(ports) == 0 {
		return out, nil
	}
	fd, err := diagSocket()
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var seq uint32
	missing := false
	for _, p := range ports {
		for _, at := range loopbacks() {
			seq++
			found, err := lookupListener(fd, at, p, seq)
			if err != nil {
				return nil, err
			}
			if found {
				out[p] = true
				break
			}
		}
		missing = missing || !out[p]
	}
	if !missing {
		return out, nil
	}
	all := map[uint16]bool{}
	if err := dumpBoth(fd, seq, all); err != nil {
		return nil, err
	}
	for _, p := range ports {
		out[p] = all[p]
	}
	return out, nil
}

// loopbacks are the addresses TCPListening looks listeners up at: a
// connection to one reaches a listener bound to it or to its family's
// wildcard (and an IPv4 one a dual-stack IPv6 wildcard's).
func loopbacks() []netip.Addr {
	return []netip.Addr{netip.AddrFrom4([4]byte{127, 0, 0, 1}), netip.IPv6Loopback()}
}

// diagSocket opens a bound NETLINK_SOCK_DIAG socket in the calling
// thread's network namespace.
func diagSocket() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return -1, fmt.Errorf("open sock_diag socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind sock_diag socket: %w", err)
	}
	return fd, nil
}

// dumpBoth dumps the listening TCP sockets of both families into out,
// numbering its requests after seq. A kernel without IPv6 has no inet6
// diag handler: no listeners there to find.
func dumpBoth(fd int, seq uint32, out map[uint16]bool) error {
	if err := dumpListening(fd, unix.AF_INET, seq+1, out); err != nil {
		return err
	}
	if err := dumpListening(fd, unix.AF_INET6, seq+2, out); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EAFNOSUPPORT) {
		return err
	}
	return nil
}

// lookupListener asks the kernel for the TCP socket a connection to
// at:port would reach (an exact inet_diag request) and reports whether it
// is a listener. Not found, or a family the kernel lacks, is false.
func lookupListener(fd int, at netip.Addr, port uint16, seq uint32) (bool, error) {
	req := make([]byte, unix.NLMSG_HDRLEN+sizeofInetDiagReqV2)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST)
	binary.NativeEndian.PutUint32(req[8:], seq)
	body := req[unix.NLMSG_HDRLEN:]
	body[0] = unix.AF_INET6
	if at.Is4() {
		body[0] = unix.AF_INET
	}
	body[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(body[4:], 1<<tcpListen)
	// inet_diag_sockid: the local port and address (the kernel looks the
	// socket up as the destination of a connection from the unset
	// remote), no device, and no cookie to match (INET_DIAG_NOCOOKIE).
	binary.BigEndian.PutUint16(body[8:], port)
	a := at.AsSlice()
	copy(body[12:28], a)
	binary.NativeEndian.PutUint32(body[48:], ^uint32(0))
	binary.NativeEndian.PutUint32(body[52:], ^uint32(0))
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, fmt.Errorf("send inet_diag request: %w", err)
	}
	buf := make([]byte, 4<<10)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return false, fmt.Errorf("receive inet_diag answer: %w", err)
		}
		got := map[uint16]bool{}
		// One answer without NLM_F_DUMP: the socket, or an error.
		_, err = parseDiagListening(buf[:n], seq, got)
		switch {
		case errors.Is(err, unix.ENOENT), errors.Is(err, unix.EAFNOSUPPORT):
			return false, nil
		case err != nil:
			return false, err
		}
		return got[port], nil
	}
}

// inet_diag wire sizes (linux/inet_diag.h).
const (
	sizeofInetDiagReqV2 = 56
	sizeofInetDiagMsg   = 72
	tcpListen           = 10 // TCP_LISTEN in the kernel's tcp_states.h
)

// dumpListening sends one inet_diag dump request for family's listening
// TCP sockets and adds their local ports to out.
func dumpListening(fd int, family uint8, seq uint32, out map[uint16]bool) error {
	req := make([]byte, unix.NLMSG_HDRLEN+sizeofInetDiagReqV2)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], seq)
	body := req[unix.NLMSG_HDRLEN:]
	body[0] = family
	body[1] = unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(body[4:], 1<<tcpListen) // idiag_states
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("send inet_diag request: %w", err)
	}
	buf := make([]byte, 32<<10)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return fmt.Errorf("receive inet_diag answer: %w", err)
		}
		done, err := parseDiagListening(buf[:n], seq, out)
		if err != nil || done {
			return err
		}
	}
}

// parseDiagListening adds the local ports of the inet_diag messages in b
// (one netlink datagram, answering request seq) to out; done is true once
// the dump's end is seen. Anything malformed is an error, never a panic.
func parseDiagListening(b []byte, seq uint32, out map[uint16]bool) (done bool, err error) {
	for len(b) > 0 {
		if len(b) < unix.NLMSG_HDRLEN {
			return false, fmt.Errorf("inet_diag: short netlink header (%d bytes)", len(b))
		}
		l := int(binary.NativeEndian.Uint32(b[0:]))
		typ := binary.NativeEndian.Uint16(b[4:])
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return false, fmt.Errorf("inet_diag: netlink message length %d out of range (%d left)", l, len(b))
		}
		msg := b[unix.NLMSG_HDRLEN:l]
		if s := binary.NativeEndian.Uint32(b[8:]); s != seq {
			return false, fmt.Errorf("inet_diag: answer to request %d, expected %d", s, seq)
		}
		switch typ {
		case unix.NLMSG_DONE:
			return true, nil
		case unix.NLMSG_ERROR:
			if len(msg) < 4 {
				return false, errors.New("inet_diag: short netlink error")
			}
			if e := int32(binary.NativeEndian.Uint32(msg)); e != 0 {
				return false, fmt.Errorf("inet_diag: %w", unix.Errno(-e))
			}
		case unix.SOCK_DIAG_BY_FAMILY:
			if len(msg) < sizeofInetDiagMsg {
				return false, fmt.Errorf("inet_diag: short message (%d bytes)", len(msg))
			}
			// idiag_state at 1; the socket id follows the four one-byte
			// fields, its source port first, in network byte order.
			if msg[1] == tcpListen {
				out[binary.BigEndian.Uint16(msg[4:])] = true
			}
		}
		// Messages are 4-byte aligned within the datagram.
		next := (l + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1)
		if next >= len(b) {
			break
		}
		b = b[next:]
	}
	return false, nil
}

// Dup returns a second handle on the same namespace, which the caller
// owns and closes independently of n (a duplicate of n's descriptor, so
// what was checked when n was opened holds for it too).
func (n *Handle) Dup() (*Handle, error) {
	fd, err := unix.FcntlInt(n.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate netns descriptor %s: %w", n.source, err)
	}
	return &Handle{f: os.NewFile(uintptr(fd), n.source), source: n.source, id: n.id}, nil
}
