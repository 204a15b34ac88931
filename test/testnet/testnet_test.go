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
