// Command flanneld is flannel's node daemon reduced to what the real node
// uses: the Kubernetes subnet manager (each node's lease is its
// spec.podCIDR, published as node annotations) and the vxlan and host-gw
// backends, with flannel's iptables forward and masquerade rules. Flannel's
// own main cannot be built from the Go module proxy (its tencentvpc
// backend needs an SDK version the proxy does not serve), and flanneld's
// wiring lives in that main package, so this is the same wiring over the
// same packages, with only these backends linked in.
//
// Flags keep flanneld's names. The node's name comes from NODE_NAME, as
// for flanneld outside a pod.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/flannel-io/flannel/pkg/backend"
	_ "github.com/flannel-io/flannel/pkg/backend/hostgw" // registers the host-gw backend
	_ "github.com/flannel-io/flannel/pkg/backend/vxlan"  // registers the vxlan backend
	"github.com/flannel-io/flannel/pkg/ip"
	"github.com/flannel-io/flannel/pkg/ipmatch"
	"github.com/flannel-io/flannel/pkg/subnet"
	"github.com/flannel-io/flannel/pkg/subnet/kube"
	"github.com/flannel-io/flannel/pkg/trafficmngr/iptables"
)

type options struct {
	kubeconfig string
	netConf    string
	subnetFile string
	iface      string
	publicIP   string
	prefix     string
	ipMasq     bool
	resync     int
}

func main() {
	var o options
	fs := flag.NewFlagSet("flanneld", flag.ExitOnError)
	fs.StringVar(&o.kubeconfig, "kubeconfig-file", "", "kubeconfig of the API server holding the nodes")
	fs.StringVar(&o.netConf, "net-config-path", "/etc/kube-flannel/net-conf.json", "flannel's network configuration (Network, Backend)")
	fs.StringVar(&o.subnetFile, "subnet-file", "/run/flannel/subnet.env", "where the node's lease (FLANNEL_SUBNET, FLANNEL_MTU ...) is written")
	fs.StringVar(&o.iface, "iface", "", "interface (name or address) that carries traffic between nodes")
	fs.StringVar(&o.publicIP, "public-ip", "", "address other nodes reach this node at")
	fs.StringVar(&o.prefix, "kube-annotation-prefix", "flannel.alpha.coreos.com", "prefix of the node annotations flannel publishes")
	fs.BoolVar(&o.ipMasq, "ip-masq", false, "masquerade traffic leaving the overlay network")
	fs.IntVar(&o.resync, "iptables-resync", 5, "seconds between iptables rule checks")
	_ = fs.Parse(os.Args[1:])

	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, o); err != nil && !errors.Is(err, context.Canceled) {
		log.Error("flanneld failed", "err", err)
		os.Exit(1)
	}
}

// run does what flanneld's main does for these backends: lease from the
// node's podCIDR, backend network, forward (and masquerade) rules, subnet
// file, then holds the lease until ctx ends. Every goroutine the backend
// and the subnet manager start is tracked by wg and stopped with ctx.
func run(parent context.Context, log *slog.Logger, o options) error {
	ctx, cancel := context.WithCancel(parent)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	sm, err := kube.NewSubnetManager(ctx, "", o.kubeconfig, o.prefix, o.netConf, true)
	if err != nil {
		return fmt.Errorf("kube subnet manager: %w", err)
	}
	config, err := networkConfig(ctx, log, sm)
	if err != nil {
		return err
	}
	stack, err := ipmatch.GetIPFamily(config.EnableIPv4, config.EnableIPv6)
	if err != nil {
		return fmt.Errorf("ip family: %w", err)
	}
	ext, err := ipmatch.LookupExtIface(o.iface, "", "", stack, ipmatch.PublicIPOpts{PublicIP: o.publicIP})
	if err != nil {
		return fmt.Errorf("interface %q: %w", o.iface, err)
	}
	be, err := backend.NewManager(ctx, sm, ext).GetBackend(config.BackendType)
	if err != nil {
		return fmt.Errorf("backend %q: %w", config.BackendType, err)
	}
	bn, err := be.RegisterNetwork(ctx, &wg, config)
	if err != nil {
		return fmt.Errorf("register network: %w", err)
	}
	tm := &iptables.IPTablesManager{}
	if err := tm.Init(ctx); err != nil {
		return fmt.Errorf("iptables: %w", err)
	}
	if o.ipMasq {
		err := tm.SetupAndEnsureMasqRules(ctx, config.Network, ip.IP4Net{}, ip.IP4Net{},
			config.IPv6Network, ip.IP6Net{}, ip.IP6Net{}, bn.Lease(), o.resync, false)
		if err != nil {
			return fmt.Errorf("masquerade rules: %w", err)
		}
	}
	tm.SetupAndEnsureForwardRules(ctx, config.Network, config.IPv6Network, o.resync)
	lease := bn.Lease()
	if err := sm.HandleSubnetFile(o.subnetFile, config, o.ipMasq, lease.Subnet, lease.IPv6Subnet, bn.MTU()); err != nil {
		return fmt.Errorf("subnet file: %w", err)
	}
	log.Info("flannel is ready", "subnet", lease.Subnet.String(), "backend", config.BackendType, "mtu", bn.MTU())

	wg.Add(1)
	go func() {
		defer wg.Done()
		bn.Run(ctx)
	}()
	if err := sm.CompleteLease(ctx, lease, &wg); err != nil {
		return fmt.Errorf("lease: %w", err)
	}
	<-ctx.Done()
	return ctx.Err()
}

// networkConfig waits for the subnet manager's network configuration, as
// flanneld does, retrying each second until ctx ends.
func networkConfig(ctx context.Context, log *slog.Logger, sm subnet.Manager) (*subnet.Config, error) {
	for {
		config, err := sm.GetNetworkConfig(ctx)
		if err == nil && config != nil {
			return config, nil
		}
		log.Warn("no network config yet", "err", err)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
