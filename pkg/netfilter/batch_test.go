package netfilter

import (
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"

	gnft "github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/containernetworking/plugins/pkg/ns"
)

func tableMsg(t *testing.T, msg int, name string) netlink.Message {
	t.Helper()
	m, err := rawMsg(msg, netlink.Create, unix.NFPROTO_INET, []netlink.Attribute{{Type: unix.NFTA_TABLE_NAME, Data: append([]byte(name), 0)}})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func socketIn(t *testing.T, n ns.NetNS) *Socket {
	t.Helper()
	var s *Socket
	if err := n.Do(func(ns.NetNS) error {
		var err error
		s, err = DialSocket()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func batchOf(t *testing.T, msgs ...netlink.Message) *Batch {
	t.Helper()
	b, err := NewBatch(msgs)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestBatchOneAck checks the kernel behaviour the sender relies on: errors
// come for messages that did not ask for an ack, after the whole batch,
// and a batch with one failing message applies nothing.
func TestBatchOneAck(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft")
	t.Run("own socket", func(t *testing.T) {
		n := testnet.NewNS(t)
		testOneAck(t, n, socketIn(t, n))
	})
	t.Run("netlink.Conn", func(t *testing.T) {
		n := testnet.NewNS(t)
		c, err := dialNetfilter(n.Path())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		s, err := socketOf(c)
		if err != nil {
			t.Fatal(err)
		}
		testOneAck(t, n, s)
		// The connection still works for requests of its own.
		if ts, err := listTables(c, unix.NFPROTO_INET); err != nil || len(ts) != 1 {
			t.Fatalf("list after batches: %v, %v", ts, err)
		}
	})
}

func testOneAck(t *testing.T, n ns.NetNS, s *Socket) {

	good := batchOf(t, tableMsg(t, unix.NFT_MSG_NEWTABLE, "a"), tableMsg(t, unix.NFT_MSG_NEWTABLE, "b"))
	if err := s.Send(good); err != nil {
		t.Fatal(err)
	}
	// The same batch again, renumbered: creating existing tables without
	// NLM_F_EXCL succeeds.
	if err := s.Send(good); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, n, "nft", "list", "tables"); out != "table inet a\ntable inet b\n" {
		t.Fatalf("tables:\n%s", out)
	}

	for _, tc := range []struct {
		name string
		msgs []netlink.Message
		idx  []int
	}{
		{"middle fails", []netlink.Message{tableMsg(t, unix.NFT_MSG_NEWTABLE, "c"), tableMsg(t, unix.NFT_MSG_DELTABLE, "nosuch"), tableMsg(t, unix.NFT_MSG_NEWTABLE, "d")}, []int{1}},
		{"last fails", []netlink.Message{tableMsg(t, unix.NFT_MSG_NEWTABLE, "c"), tableMsg(t, unix.NFT_MSG_DELTABLE, "nosuch")}, []int{1}},
		{"two fail", []netlink.Message{tableMsg(t, unix.NFT_MSG_DELTABLE, "nosuch1"), tableMsg(t, unix.NFT_MSG_NEWTABLE, "c"), tableMsg(t, unix.NFT_MSG_DELTABLE, "nosuch2"), tableMsg(t, unix.NFT_MSG_NEWTABLE, "d")}, []int{0, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := s.Send(batchOf(t, tc.msgs...))
			if err == nil {
				t.Fatal("batch with a failing message succeeded")
			}
			t.Log(err)
			if !errors.Is(err, unix.ENOENT) {
				t.Fatalf("error %v is not ENOENT", err)
			}
			for _, i := range tc.idx {
				if want := "message " + string(rune('0'+i)) + " (DELTABLE)"; !strings.Contains(err.Error(), want) {
					t.Fatalf("error %q does not name %q", err, want)
				}
			}
			if got := strings.Count(err.Error(), "DELTABLE"); got != len(tc.idx) {
				t.Fatalf("error %q names %d messages, want %d", err, got, len(tc.idx))
			}
			if out := sh(t, n, "nft", "list", "tables"); out != "table inet a\ntable inet b\n" {
				t.Fatalf("failed batch left tables:\n%s", out)
			}
		})
	}
	// The socket is still in step after failures.
	if err := s.Send(batchOf(t, tableMsg(t, unix.NFT_MSG_DELTABLE, "a"))); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, n, "nft", "list", "tables"); out != "table inet b\n" {
		t.Fatalf("tables:\n%s", out)
	}
}

// TestCaptureMatchesGoogleNftables checks that a captured batch carries
// google/nftables' messages unchanged but for the ack and echo flags.
func TestCaptureMatchesGoogleNftables(t *testing.T) {
	queue := func(c *gnft.Conn) error {
		tbl := c.AddTable(&gnft.Table{Name: "t", Family: gnft.TableFamilyINet})
		ch := c.AddChain(&gnft.Chain{Name: "c", Table: tbl})
		c.AddRule(&gnft.Rule{Table: tbl, Chain: ch, UserData: []byte("x")})
		return nil
	}
	var sent []netlink.Message
	c, err := gnft.New(gnft.WithTestDial(func(req []netlink.Message) ([]netlink.Message, error) {
		if req != nil && sent == nil {
			sent = req
		}
		return nil, io.EOF
	}))
	if err != nil {
		t.Fatal(err)
	}
	_ = queue(c)
	_ = c.Flush()
	r, err := NewRecorder()
	if err != nil {
		t.Fatal(err)
	}
	_ = queue(r.Conn)
	b, err := r.Batch()
	if err != nil {
		t.Fatal(err)
	}
	if again, err := r.Batch(); err != nil || again.Len() != 0 {
		t.Fatalf("recorder not emptied: %v, %d messages", err, again.Len())
	}
	got := b.Bytes(100)
	if b.Len() != len(sent)-2 || len(b.offs) != len(sent) {
		t.Fatalf("%d messages, google/nftables sent %d", len(b.offs), len(sent))
	}
	for i, m := range sent {
		off := b.offs[i]
		h := got[off : off+nlmsghdr]
		if l := int(binary.NativeEndian.Uint32(h)); l != nlmsghdr+len(m.Data) {
			t.Fatalf("message %d: length %d, want %d", i, l, nlmsghdr+len(m.Data))
		}
		if typ := binary.NativeEndian.Uint16(h[4:]); typ != uint16(m.Header.Type) {
			t.Fatalf("message %d: type %#x, want %#x", i, typ, m.Header.Type)
		}
		wantFlags := m.Header.Flags &^ (netlink.Acknowledge | netlink.Echo)
		if i == len(sent)-2 {
			wantFlags |= netlink.Acknowledge
		}
		if f := netlink.HeaderFlags(binary.NativeEndian.Uint16(h[6:])); f != wantFlags {
			t.Fatalf("message %d: flags %v, want %v", i, f, wantFlags)
		}
		if seq := binary.NativeEndian.Uint32(h[8:]); seq != 100+uint32(i) {
			t.Fatalf("message %d: seq %d", i, seq)
		}
		if data := got[off+nlmsghdr : off+nlmsghdr+len(m.Data)]; string(data) != string(m.Data) {
			t.Fatalf("message %d: payload differs:\n%x\n%x", i, data, m.Data)
		}
	}
}

func TestNewBatchRefuses(t *testing.T) {
	if _, err := NewBatch([]netlink.Message{{Header: netlink.Header{Type: 16}}}); err == nil {
		t.Fatal("non-nf_tables message accepted")
	}
	if _, err := NewBatch([]netlink.Message{{Header: netlink.Header{Type: nftType(unix.NFT_MSG_NEWTABLE)}, Data: make([]byte, 2<<20)}}); err == nil {
		t.Fatal("oversized message accepted")
	}
}

// answer encodes one NLMSG_ERROR answer as the kernel sends it with
// NETLINK_CAP_ACK.
func answer(seq uint32, errno int32, msg string) []byte {
	var b []byte
	flags := uint16(nlmFCapped)
	var tlv []byte
	if msg != "" {
		flags |= nlmFAckTLVs
		a, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NLMSGERR_ATTR_MSG, Data: append([]byte(msg), 0)}})
		tlv = a
	}
	n := nlmsghdr + nlmsgerr + len(tlv)
	b = binary.NativeEndian.AppendUint32(b, uint32(n))
	b = binary.NativeEndian.AppendUint16(b, unix.NLMSG_ERROR)
	b = binary.NativeEndian.AppendUint16(b, flags)
	b = binary.NativeEndian.AppendUint32(b, seq)
	b = binary.NativeEndian.AppendUint32(b, 0)
	b = binary.NativeEndian.AppendUint32(b, uint32(-errno))
	b = append(b, make([]byte, nlmsghdr)...)
	return append(b, tlv...)
}

func TestParseAnswers(t *testing.T) {
	types := []uint16{unix.NFNL_MSG_BATCH_BEGIN, uint16(nftType(unix.NFT_MSG_NEWTABLE)), uint16(nftType(unix.NFT_MSG_NEWRULE)), unix.NFNL_MSG_BATCH_END}
	newW := func() *answers { return &answers{first: 10, last: 12, types: types} }

	w := newW()
	if err := w.parse(answer(12, 0, "")); err != nil || !w.done || w.fail(nil) != nil {
		t.Fatalf("ack: err %v done %v", err, w.done)
	}
	w = newW()
	if err := w.parse(append(answer(11, 2, "No such file"), answer(99, 0, "")...)); err != nil || w.done {
		t.Fatalf("error then stranger: err %v done %v", err, w.done)
	}
	if err := w.parse(answer(12, 0, "")); err != nil || !w.done {
		t.Fatalf("ack after error: %v", err)
	}
	err := w.fail(nil)
	var me *MessageError
	if !errors.As(err, &me) || me.Index != 0 || me.Type != unix.NFT_MSG_NEWTABLE || me.Errno != unix.ENOENT || me.Msg != "No such file" {
		t.Fatalf("error %v (%+v)", err, me)
	}
	w = newW()
	if err := w.parse(answer(10, 1, "")); err != nil || !w.done {
		t.Fatalf("refused batch: err %v done %v", err, w.done)
	}
	if err := w.fail(nil); !errors.Is(err, unix.EPERM) || !strings.Contains(err.Error(), "batch refused") {
		t.Fatalf("refused batch: %v", err)
	}

	// Sequence numbers that wrap inside the batch.
	w = &answers{first: 0xffffffff, last: 1, types: types}
	if err := w.parse(append(answer(0, 2, ""), answer(5, 0, "")...)); err != nil || w.done {
		t.Fatalf("wrapped: err %v done %v", err, w.done)
	}
	if err := w.parse(answer(1, 0, "")); err != nil || !w.done || !errors.As(w.fail(nil), &me) || me.Index != 0 {
		t.Fatalf("wrapped: err %v done %v, %+v", err, w.done, me)
	}

	long := answer(12, 22, strings.Repeat("x", 1000))
	w = newW()
	if err := w.parse(long); err != nil || !w.done {
		t.Fatal(err)
	}
	if !errors.As(w.fail(nil), &me) || len(me.Msg) != maxAckMsg {
		t.Fatalf("long explanation kept as %d bytes", len(me.Msg))
	}

	for name, b := range map[string][]byte{
		"short header":   {1, 2, 3},
		"length too big": answer(12, 0, "")[:20],
		"length small":   func() []byte { b := answer(12, 0, ""); b[0] = 4; return b }(),
		"short error":    func() []byte { b := answer(12, 0, "")[:20]; b[0] = 20; return b }(),
		"positive errno": answer(12, -5, ""),
		"uncapped bad":   func() []byte { b := answer(12, 2, "m"); b[6], b[7] = 0, byte(nlmFAckTLVs>>8); b[20] = 200; return b }(),
	} {
		w := newW()
		if err := w.parse(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzParseAnswers(f *testing.F) {
	f.Add(answer(12, 0, ""))
	f.Add(answer(11, 2, "No such file or directory"))
	f.Add(append(answer(10, 1, ""), answer(12, 0, "")...))
	types := []uint16{unix.NFNL_MSG_BATCH_BEGIN, uint16(nftType(unix.NFT_MSG_NEWTABLE)), uint16(nftType(unix.NFT_MSG_NEWRULE)), unix.NFNL_MSG_BATCH_END}
	f.Fuzz(func(t *testing.T, b []byte) {
		w := &answers{first: 10, last: 12, types: types}
		_ = w.parse(b)
		for _, e := range w.errs {
			var me *MessageError
			if errors.As(e, &me) && (me.Index < -1 || me.Index > 1 || len(me.Msg) > maxAckMsg) {
				t.Fatalf("error out of range: %+v", me)
			}
		}
	})
}
