// Package sandbox runs the project's main job on this machine, end to end
// and for real: an API server, the install-cni process (installer + node
// agent), a ztunnel stand-in, and simulated kubelet pods whose CNI ADD goes
// through a real bridge chain. It labels a namespace ambient and shows the
// pods' traffic move through ztunnel, then cleans everything up.
package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/captureproxy"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/scrape"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// Options configure Run.
type Options struct {
	// Dir holds everything the sandbox creates; it is removed at the end.
	Dir string
	// InstallCNI is the install-cni binary to run (make build puts it in bin/).
	InstallCNI string
	// Stay keeps the sandbox running after the demo until ctx ends, for
	// exploring it with kubectl.
	Stay bool
	// Out receives the narrative.
	Out io.Writer
}

// Run runs the sandbox demo. It needs root.
func Run(ctx context.Context, opts Options) (err error) {
	if os.Geteuid() != 0 {
		return errors.New("the sandbox creates network namespaces and iptables rules: run it as root")
	}
	out := opts.Out
	say := func(format string, args ...any) { fmt.Fprintf(out, format+"\n", args...) }
	o := &kubesim.Owner{Dir: opts.Dir}
	defer func() {
		say("cleaning up")
		o.Close()
	}()
	return kubesim.Catch(func() error { return run(ctx, opts, o, say) })
}

// run is the demo; o owns what it starts.
func run(ctx context.Context, opts Options, o *kubesim.Owner, say func(string, ...any)) error {
	say("== starting etcd and kube-apiserver")
	env, err := kubeenv.Launch(ctx, kubeenv.Options{Dir: filepath.Join(opts.Dir, "kube")})
	if err != nil {
		return fmt.Errorf("start API server (build it with %s): %w", kubeenv.BuildCommand, err)
	}
	o.Cleanup(env.Stop)
	kubeconfig := filepath.Join(opts.Dir, "kubeconfig")
	if err := kubeenv.WriteKubeconfig(env.Config, kubeconfig); err != nil {
		return err
	}
	say("   API server ready in %v; admin kubeconfig: %s", env.StartTime.Round(time.Millisecond), kubeconfig)

	say("== building the reference CNI plugins and ours")
	cniPaths, pluginBin, err := cnibin.Build()
	if err != nil {
		return err
	}
	chart, err := simnode.CommittedChart()
	if err != nil {
		return err
	}
	var r [2]byte
	_, _ = rand.Read(r[:])
	healthAddr, err := freeAddr()
	if err != nil {
		return err
	}
	metricsAddr, err := freeAddr()
	if err != nil {
		return err
	}
	say("== starting install-cni (installer + node agent) with the chart's environment, and the ztunnel stand-in")
	node, err := simnode.Start(ctx, simnode.Options{
		Env: env, Chart: chart, InstallCNI: opts.InstallCNI, Plugin: pluginBin,
		ReferencePlugins: cniPaths[0], Dir: filepath.Join(opts.Dir, "node"), Name: "sandbox-node",
		Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 100 + r[0]%100, r[1], 0}), 24),
		// make sandbox runs in the machine's own network namespace, where
		// the chart's fixed ports may be taken (by a real node's agent):
		// free loopback ports instead.
		Settings: map[string]string{"health-addr": healthAddr, "metrics-addr": metricsAddr},
	})
	if err != nil {
		return fmt.Errorf("simulated node: %w", err)
	}
	o.Cleanup(func() {
		if err := node.Close(); err != nil {
			say("   stopping the node: %v", err)
		}
	})
	zt := node.StandIn()
	say("   primary CNI config %s: bridge %s; logs: %s; readiness: install-cni probe ready --agent-socket %s", filepath.Join(node.ConfDir, simnode.PrimaryConf), node.Bridge, node.LogPath, node.Config.AgentSocket)
	say("   ready: the installer chained %q into %s", cnibin.PluginName, simnode.PrimaryConf)

	client := env.Client
	kube, err := node.Kubelet(o)
	if err != nil {
		return err
	}
	for _, ns := range []string{"demo", "plain"} {
		if err := createNamespace(ctx, client, ns); err != nil {
			return err
		}
	}
	say("== starting pods: demo/client, demo/server (app on :8080), plain/outsider")
	pods := map[string]*kubesim.Pod{}
	for _, p := range [][2]string{{"demo", "client"}, {"demo", "server"}, {"plain", "outsider"}} {
		pod, err := kube.Run(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: p[0], Name: p[1]}})
		if err != nil {
			return err
		}
		pods[p[1]] = pod
	}
	app, err := captureproxy.Start(pods["server"].NS.Path(), captureproxy.Config{TCPPorts: []uint16{8080}, NoIPv6: true})
	if err != nil {
		return err
	}
	o.Cleanup(func() { _ = app.Close() })
	server := netip.AddrPortFrom(pods["server"].Addr(4), 8080)

	call := func(from string) error {
		before := len(zt.Records())
		if _, err := captureproxy.Dial(ctx, pods[from].NS.Path(), server, captureproxy.DialOptions{}); err != nil {
			return fmt.Errorf("%s -> server: %w", from, err)
		}
		recs := zt.Records()[before:]
		if len(recs) == 0 {
			say("   %s -> %s: reached the app directly (ztunnel saw nothing)", from, server)
			return nil
		}
		// The stand-in records a hop once its upstream is connected, so
		// the inbound hop may be recorded before the outbound one that
		// tunnelled to it; a connection's path runs outbound (15001)
		// before inbound (15006, 15008), which is port order.
		slices.SortStableFunc(recs, func(a, b ztunnel.Record) int { return a.Port - b.Port })
		var hops []string
		for _, r := range recs {
			hops = append(hops, fmt.Sprintf("%s:%d", podName(zt, r.UID), r.Port))
		}
		say("   %s -> %s: through ztunnel via %s", from, server, strings.Join(hops, " then "))
		return nil
	}
	if err := call("client"); err != nil {
		return err
	}

	say("== labelling namespace demo %s=%s", ambient.DataplaneModeLabel, ambient.DataplaneModeAmbient)
	start := time.Now()
	if err := labelNamespace(ctx, client, "demo", ambient.DataplaneModeAmbient); err != nil {
		return err
	}
	if err := waitAnnotations(ctx, client, "demo", []string{"client", "server"}, ambient.RedirectionEnabled); err != nil {
		return err
	}
	say("   client and server annotated %s=%s after %v", ambient.RedirectionAnnotation, ambient.RedirectionEnabled, time.Since(start).Round(time.Millisecond))
	if err := call("client"); err != nil {
		return err
	}
	if err := call("outsider"); err != nil {
		return err
	}

	say("== starting demo/late: enrolled by its own CNI ADD before it runs")
	late, err := kube.Run(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "demo", Name: "late"}})
	if err != nil {
		return err
	}
	lp, err := client.CoreV1().Pods("demo").Get(ctx, "late", metav1.GetOptions{})
	if err != nil {
		return err
	}
	say("   demo/late at %s: %s=%q", late.Addr(4), ambient.RedirectionAnnotation, lp.Annotations[ambient.RedirectionAnnotation])

	say("== removing the label from namespace demo")
	if err := labelNamespace(ctx, client, "demo", ""); err != nil {
		return err
	}
	if err := waitAnnotations(ctx, client, "demo", []string{"client", "server", "late"}, ""); err != nil {
		return err
	}
	// The agent drops the annotation first (istiod stops sending HBONE),
	// then the rules, then tells ztunnel.
	if err := poll.Wait(ctx, 30*time.Second, func() bool { return len(zt.Workloads()) == 0 }); err != nil {
		return fmt.Errorf("ztunnel still serves pods after unlabel: %w", err)
	}
	say("   annotations removed, rules and ztunnel listeners gone")
	if err := call("client"); err != nil {
		return err
	}
	say("== agent metrics (excerpt)")
	metrics, _ := scrape.Text(node.MetricsURL) // an excerpt for the reader: none is no failure
	for _, l := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(l, "ambient_cni_cni_requests_total") || strings.HasPrefix(l, "ambient_cni_enrolled_pods") {
			say("   %s", l)
		}
	}
	if opts.Stay {
		say("== sandbox up; kubectl --kubeconfig %s get pods -A; Ctrl-C to stop", kubeconfig)
		<-ctx.Done()
	}
	return nil
}

func podName(zt *ztunnel.StandIn, uid string) string {
	if w, ok := zt.Workload(uid); ok {
		return w.Info.Name
	}
	return uid
}

func createNamespace(ctx context.Context, c kubernetes.Interface, name string) error {
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	// No controller-manager here: make the default ServiceAccount ourselves.
	_, err := c.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create default service account in %s: %w", name, err)
	}
	return nil
}

func labelNamespace(ctx context.Context, c kubernetes.Interface, name, value string) error {
	var v any
	if value != "" {
		v = value
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{ambient.DataplaneModeLabel: v}}})
	_, err := c.CoreV1().Namespaces().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

func waitAnnotations(ctx context.Context, c kubernetes.Interface, ns string, names []string, want string) error {
	return poll.Wait(ctx, 30*time.Second, func() bool {
		for _, n := range names {
			p, err := c.CoreV1().Pods(ns).Get(ctx, n, metav1.GetOptions{})
			if err != nil || p.Annotations[ambient.RedirectionAnnotation] != want {
				return false
			}
		}
		return true
	})
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}
