package cni

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

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
	stdin := []byte(fmt.Sprintf(`{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"ambient-cni","agentSocket":%q,"prevResult":%s}`, n.sock, prev))
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
