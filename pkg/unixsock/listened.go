package unixsock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Listened reports whether a process of this network namespace listens on
// the Unix socket file at path: the kernel's socket diagnostics
// (sock_diag, as ss -xl) list every listening Unix socket with the inode
// and device of the file it is bound to, matched here against the file's.
// Unlike a dial it leaves the listener alone: a server that counts every
// connection it accepts as a client (istio-cni's ZDS server takes the
// latest for ztunnel) never sees it. false, with no error, when path does
// not exist or is not a socket; a socket file left by a process that is
// gone is not listened on.
func Listened(path string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, &fs.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return false, nil
	}
	socks, err := listening()
	if err != nil {
		return false, fmt.Errorf("list the listening unix sockets: %w", err)
	}
	// sock_diag gives the superblock's device as the kernel keeps it
	// (major<<20 | minor), stat its userspace encoding; the inode
	// truncated to 32 bits.
	dev := uint32(unix.Major(st.Dev))<<20 | uint32(unix.Minor(st.Dev))
	for _, s := range socks {
		if s.ino == uint32(st.Ino) && s.dev == dev {
			return true, nil
		}
	}
	return false, nil
}

// boundFile is the file a listening socket is bound to (unix_diag_vfs).
type boundFile struct{ ino, dev uint32 }

// sock_diag's Unix family request and answer (linux/unix_diag.h).
const (
	udiagShowVFS  = 0x2
	unixDiagVFS   = 1
	tcpListen     = 10
	sizeofDiagReq = 24
	sizeofDiagMsg = 16
	sizeofDiagVFS = 8
	sockDiagByFam = 20
)

type diagReq struct{}

func (diagReq) Len() int { return sizeofDiagReq }

func (diagReq) Serialize() []byte {
	b := make([]byte, sizeofDiagReq)
	b[0] = unix.AF_UNIX
	binary.NativeEndian.PutUint32(b[4:], 1<<tcpListen)
	binary.NativeEndian.PutUint32(b[12:], udiagShowVFS)
	return b
}

// listening lists the files the listening Unix sockets of this network
// namespace are bound to (abstract and unbound ones have none).
func listening() ([]boundFile, error) {
	var msgs [][]byte
	var err error
	// A dump that sockets came or went during may miss some: asked again.
	for range 5 {
		req := nl.NewNetlinkRequest(sockDiagByFam, unix.NLM_F_DUMP)
		req.AddData(diagReq{})
		if msgs, err = req.Execute(unix.NETLINK_SOCK_DIAG, sockDiagByFam); !errors.Is(err, nl.ErrDumpInterrupted) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	return parseListening(msgs)
}

// parseListening reads sock_diag's answers: a unix_diag_msg, then
// attributes, of which UNIX_DIAG_VFS is the bound file.
func parseListening(msgs [][]byte) ([]boundFile, error) {
	var out []boundFile
	for _, m := range msgs {
		if len(m) < sizeofDiagMsg {
			return nil, fmt.Errorf("sock_diag answer of %d bytes, shorter than its header", len(m))
		}
		if m[0] != unix.AF_UNIX {
			continue
		}
		// The attributes (rtattr: length, type, value, padded to 4),
		// read here: nl.ParseRouteAttr panics on a length past the end.
		for b := m[sizeofDiagMsg:]; len(b) > 0; {
			if len(b) < 4 {
				return nil, fmt.Errorf("sock_diag attribute of %d bytes, shorter than its header", len(b))
			}
			n, typ := int(binary.NativeEndian.Uint16(b)), binary.NativeEndian.Uint16(b[2:])
			if n < 4 || n > len(b) {
				return nil, fmt.Errorf("sock_diag attribute of length %d in %d bytes", n, len(b))
			}
			if typ == unixDiagVFS {
				if n-4 < sizeofDiagVFS {
					return nil, fmt.Errorf("sock_diag bound file of %d bytes", n-4)
				}
				out = append(out, boundFile{ino: binary.NativeEndian.Uint32(b[4:]), dev: binary.NativeEndian.Uint32(b[8:])})
			}
			b = b[min((n+3)&^3, len(b)):]
		}
	}
	return out, nil
}
