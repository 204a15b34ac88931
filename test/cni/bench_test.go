package cni

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
)

// BenchmarkPluginAddPassThrough measures the wall time of one exec of the
// plugin binary (built as `make build` does) doing ADD for a pass-through
// pod: "agent" asks the running agent, which answers not-enrolled;
// "excluded" is a kube-system pod that never leaves the plugin. It reports
// the median per exec and the binary's size.
func BenchmarkPluginAddPassThrough(b *testing.B) {
	for _, tc := range []struct {
		name, namespace string
	}{{"agent", "plain"}, {"excluded", "kube-system"}} {
		b.Run(tc.name, func(b *testing.B) { benchAdd(b, tc.namespace) })
	}
}

func benchAdd(b *testing.B, namespace string) {
	n := newNode(b, "1.0.0", nil)
	s := n.newPod(namespace, "bench", nil)
	bin := cnibin.Plugin(b)
	st, err := os.Stat(bin)
	if err != nil {
		b.Fatal(err)
	}
	prev := `{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","mac":"aa:bb:cc:dd:ee:02","sandbox":"` + s.ns.Path() + `"}],` +
		`"ips":[{"interface":0,"address":"10.1.0.5/24","gateway":"10.1.0.1"}]}`
	stdin := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"ambient-cni","agentSocket":%q,"prevResult":%s}`, n.layout.AgentSocket(), prev))
	env := []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=" + s.id, "CNI_NETNS=" + s.ns.Path(), "CNI_IFNAME=eth0", "CNI_PATH=/nonexistent",
		"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + namespace + ";K8S_POD_NAME=bench;K8S_POD_UID=" + s.uid + ";K8S_POD_INFRA_CONTAINER_ID=" + s.id}
	times := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		cmd := exec.Command(bin)
		cmd.Stdin = bytes.NewReader(stdin)
		cmd.Env = env
		start := time.Now()
		out, err := cmd.Output()
		times = append(times, time.Since(start))
		if err != nil {
			b.Fatalf("ADD: %v\n%s", err, out)
		}
	}
	b.StopTimer()
	slices.Sort(times)
	b.ReportMetric(float64(times[len(times)/2].Microseconds()), "median-µs/ADD")
	b.ReportMetric(float64(st.Size()), "binary-bytes")
	if len(n.agent.Pods()) != 0 {
		b.Fatalf("pass-through pod was enrolled")
	}
}

// BenchmarkChainPassThrough measures what the plugin adds to a chain for a
// pod outside the mesh, as the runtime sees it: libcni runs ADD then DEL
// through bridge + host-local alone ("bare") and with our plugin chained
// after them, interleaved, one pod of a namespace the agent does not
// enroll. It reports the wall-time medians and their difference, and the
// CPU time (user + system) the plugins' processes used per ADD and DEL,
// bare and chained: their difference is the plugin's own cost, which a
// busy machine does not blur as it does wall time.
func BenchmarkChainPassThrough(b *testing.B) {
	// The plugin logs at its default level, as shipped.
	n := newNode(b, "1.0.0", map[string]any{"logLevel": "warn"})
	bare := &libcni.NetworkConfigList{Name: n.list.Name, CNIVersion: n.list.CNIVersion, Plugins: n.list.Plugins[:1]}
	pods := [2]*sandbox{n.newPod("plain", "bench-bare", nil), n.newPod("plain", "bench-chained", nil)}
	lists := [2]*libcni.NetworkConfigList{bare, n.list}
	var add, del [2][]time.Duration
	var addCPU, delCPU [2]time.Duration
	ctx := context.Background()
	b.ResetTimer()
	for range b.N {
		for i, l := range lists {
			c0, start := childCPU(b), time.Now()
			if _, err := n.cni.AddNetworkList(ctx, l, pods[i].rt()); err != nil {
				b.Fatalf("ADD through %d plugins: %v", len(l.Plugins), err)
			}
			c1, mid := childCPU(b), time.Now()
			if err := n.cni.DelNetworkList(ctx, l, pods[i].rt()); err != nil {
				b.Fatalf("DEL through %d plugins: %v", len(l.Plugins), err)
			}
			add[i], del[i] = append(add[i], mid.Sub(start)), append(del[i], time.Since(mid))
			addCPU[i], delCPU[i] = addCPU[i]+c1-c0, delCPU[i]+childCPU(b)-c1
		}
	}
	b.StopTimer()
	perOp := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(b.N) }
	b.ReportMetric(perOp(addCPU[1]-addCPU[0]), "Δ-ADD-cpu-µs")
	b.ReportMetric(perOp(delCPU[1]-delCPU[0]), "Δ-DEL-cpu-µs")
	med := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2].Microseconds())
	}
	b.ReportMetric(med(add[0]), "bare-ADD-p50-µs")
	b.ReportMetric(med(add[1]), "chained-ADD-p50-µs")
	b.ReportMetric(med(add[1])-med(add[0]), "Δ-ADD-p50-µs")
	b.ReportMetric(med(del[1])-med(del[0]), "Δ-DEL-p50-µs")
	if len(n.agent.Pods()) != 0 {
		b.Fatalf("pass-through pod was enrolled")
	}
}

// childCPU is the CPU time the process's waited-for children have used.
func childCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
