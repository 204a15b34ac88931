package testnet

import (
	"net"
	"net/netip"
	"testing"
	"time"
)

func TestPairConnects(t *testing.T) {
	RequireRoot(t)
	p := NewPair(t)
	for _, dst := range []netip.Addr{p.B.V4, p.B.V6} {
		var ln net.Listener
		p.B.Do(t, func() (err error) {
			ln, err = net.Listen("tcp", netip.AddrPortFrom(dst, 0).String())
			return err
		})
		defer ln.Close()
		p.A.Do(t, func() error {
			c, err := net.DialTimeout("tcp", ln.Addr().String(), 2*time.Second)
			if err == nil {
				c.Close()
			}
			return err
		})
	}
}

// NewPair returns links a peer can resolve at once: IPv6 addresses have
// joined their solicited-node groups (which the kernel does after "link
// up" returned).
func TestPairReady(t *testing.T) {
	RequireRoot(t)
	for range 20 {
		p := NewPair(t)
		for _, pod := range []Pod{p.A, p.B} {
			pod.Do(t, func() error { return linkReady(pod.IfName) })
		}
	}
}

func TestJoined(t *testing.T) {
	igmp6 := `1    lo              ff020000000000000000000000000001     1 0000000C 0
7    eth0            ff0200000000000000000001ff000002     1 00000004 0
7    eth0            ff020000000000000000000000000001     1 0000000C 0
`
	for _, tc := range []struct {
		ip    string
		index int
		want  bool
	}{
		{"fd00:1:2::2", 7, true},
		{"fd00:9:9::2", 7, true}, // the group is the last 24 bits only
		{"fd00:1:2::3", 7, false},
		{"fd00:1:2::2", 8, false},
	} {
		if got := joined(igmp6, tc.index, netip.MustParseAddr(tc.ip)); got != tc.want {
			t.Errorf("joined(%s on %d) = %v, want %v", tc.ip, tc.index, got, tc.want)
		}
	}
}
