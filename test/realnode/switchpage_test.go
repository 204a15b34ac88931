//go:build realnode

package realnode

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/kubectlplugin"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// migrationPage is the page whose commands the switch test runs.
const migrationPage = "docs/migrating-from-istio-cni.md"

// pageRunner runs the migration page's shell blocks as an operator does,
// from a directory holding the istio-cni values file and the repository's
// deploy directory, with the page's variables set. The node's own paths
// (its CNI and agent directories, the API server on loopback, istio-cni's
// run directory) are added to every helm install and upgrade of
// ambient-cni's chart as a last -f, by a helm on PATH that wraps the real
// one: the page's commands stay as written.
type pageRunner struct {
	dir, path string
	env       []string
	switchBlk []string
	rollBlk   []string
}

func (s *switchTest) pageRunner(t *testing.T) *pageRunner {
	t.Helper()
	n := s.n
	if n.Tools.Kubectl == "" {
		t.Fatalf("kubectl is not built: hack/kube-tools.sh kubectl")
	}
	page := filepath.Join(n.Tools.Repo, migrationPage)
	sw, err := kubectlplugin.PageBlocks(page, kubectlplugin.PageSwitchSection)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := kubectlplugin.PageBlocks(page, "## The rollback, node by node")
	if err != nil {
		t.Fatal(err)
	}
	// The rollback's section: the node's block, the mend of a broken
	// release, then the proof's own command.
	if len(sw) != 5 || len(rb) < 2 || !strings.HasPrefix(rb[1], "helm rollback ambient-cni ") {
		t.Fatalf("%s: %d switch blocks and %d rollback blocks, want 5, and the node's block then the mend's (%q)", migrationPage, len(sw), len(rb), rb)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(n.Tools.Repo, "deploy"), filepath.Join(dir, "deploy")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(n.Tools.Kubectl, filepath.Join(bin, "kubectl")); err != nil {
		t.Fatal(err)
	}
	values, err := os.ReadFile(s.ourValues(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "istio-cni-values.yaml"), values, 0o644); err != nil {
		t.Fatal(err)
	}
	nv := n.ChartValues(ImageTag)
	nv["migration"] = map[string]any{"fromIstioCNI": map[string]any{"runDir": s.ic.RunDir}}
	nodeValues, err := n.writeValues("page-node-values.yaml", nv)
	if err != nil {
		t.Fatal(err)
	}
	h := filepath.Join(n.Dir, "helm")
	shim := fmt.Sprintf(`#!/bin/sh
export HELM_CACHE_HOME=%[1]q HELM_CONFIG_HOME=%[2]q HELM_DATA_HOME=%[3]q
case "$1 $2" in
"install ambient-cni"|"upgrade ambient-cni") exec %[4]q "$@" -f %[5]q ;;
esac
exec %[4]q "$@"
`, filepath.Join(h, "cache"), filepath.Join(h, "config"), filepath.Join(h, "data"), n.Tools.Helm, nodeValues)
	if err := os.WriteFile(filepath.Join(bin, "helm"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	return &pageRunner{
		dir: dir, path: bin + ":" + os.Getenv("PATH"),
		env: []string{"KUBECONFIG=" + n.Kubeconfig, "NODE=" + n.Name,
			"IMAGE_REPOSITORY=" + n.AgentRepository(), "IMAGE_TAG=" + ImageTag},
		switchBlk: sw, rollBlk: rb,
	}
}

// run runs one block with sh -e, as pasted into a shell that stops at the
// first failing command.
func (r *pageRunner) run(ctx context.Context, t *testing.T, block string) error {
	return r.runFor(ctx, t, "", block)
}

// runFor is run with NODE set to node (the first node's name when empty).
func (r *pageRunner) runFor(ctx context.Context, t *testing.T, node, block string) error {
	cmd := exec.CommandContext(ctx, "sh", "-ec", block)
	cmd.Dir = r.dir
	cmd.Env = append(append(os.Environ(), "PATH="+r.path), r.env...)
	if node != "" {
		cmd.Env = append(cmd.Env, "NODE="+node) // the last of a name wins
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	begin := time.Now()
	err := cmd.Run()
	t.Logf("page block (%v):\n%s\n--\n%s", time.Since(begin).Round(10*time.Millisecond), block, out.String())
	if err != nil {
		return fmt.Errorf("the page's block\n%s\nfailed: %w: %s", block, err, out.String())
	}
	return nil
}

// podKind is a kind of pod created on the switching node throughout.
type podKind struct {
	name, ns string
	labels   map[string]string
	// ambient pods must start captured or wait; the others must start.
	ambient bool
}

// optNS is a namespace without the ambient label whose pods opt in by
// their own label.
const optNS = "life-opt"

var podKinds = []podKind{
	{name: "ns", ns: lifeNS, ambient: true},
	{name: "label", ns: optNS, labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}, ambient: true},
	{name: "plain", ns: sinkNS},
	{name: "sys", ns: ReleaseNamespace},
}

// kindPod is a pod created during a step.
type kindPod struct {
	kind   podKind
	name   string
	waited time.Duration
	err    error
}

// podPlace is a node a step creates its pods on and checks them: the
// first node (onFirst) or a worker (onWorker).
type podPlace struct {
	appPod func(namespace, name string, o AppOptions) *corev1.Pod
	// captured: enrolled, rules in its netns, served by the node's stand-in.
	captured func(context.Context, *corev1.Pod) (bool, error)
	// records are what the node's stand-in proxied.
	records func(context.Context) ([]ztunnel.Record, error)
}

func (s *switchTest) onFirst() podPlace {
	return podPlace{appPod: s.n.AppPod, captured: s.n.captured, records: s.n.StandInRecords}
}

func onWorker(w *Worker) podPlace {
	return podPlace{appPod: w.AppPod, captured: w.captured, records: w.StandInRecords}
}

// createKindsDuring creates a pod of each kind in turn every 2 seconds on
// at while roll runs, and waits until each is Ready.
func (s *switchTest) createKindsDuring(t *testing.T, at podPlace, kinds []podKind, prefix string, roll func() error) ([]kindPod, error) {
	t.Helper()
	ctx := context.Background()
	rolled := make(chan error, 1)
	go func() { rolled <- roll() }() // owner: this function, which waits for it
	var (
		mu   sync.Mutex
		pods []kindPod
		wg   sync.WaitGroup
	)
	i := 0
	create := func() {
		k := kinds[i%len(kinds)]
		i++
		s.seq++
		name := fmt.Sprintf("%s-%s-%d", prefix, k.name, s.seq)
		o := AppOptions{Labels: k.labels}
		if k.ambient {
			o.Hello = s.sinkURL("/hello-" + name)
		}
		begin := time.Now()
		_, err := s.n.Client.CoreV1().Pods(k.ns).Create(ctx, at.appPod(k.ns, name, o), metav1.CreateOptions{})
		wg.Add(1)
		go func() { // owner: createKindsDuring, which waits on wg
			defer wg.Done()
			if err == nil {
				_, err = s.n.WaitPodReady(ctx, k.ns, name)
			}
			mu.Lock()
			pods = append(pods, kindPod{kind: k, name: name, waited: time.Since(begin), err: err})
			mu.Unlock()
		}()
	}
	var rollErr error
	for done := false; !done; {
		create()
		select {
		case rollErr = <-rolled:
			done = true
		case <-time.After(2 * time.Second): // spread the pods over the roll; not a wait for anything
		}
	}
	// One of each kind after the step, too.
	for range kinds {
		create()
	}
	wg.Wait()
	return pods, rollErr
}

// checkKinds asserts every pod created on at during a step is Ready; the
// ambient ones captured, and started captured; the others not captured.
// It prints each kind's longest wait.
func (s *switchTest) checkKinds(t *testing.T, at podPlace, kinds []podKind, what string, pods []kindPod) {
	t.Helper()
	ctx := context.Background()
	longest := map[string]time.Duration{}
	startedOut := 0
	for _, kp := range pods {
		if kp.err != nil {
			t.Errorf("%s: %s (%s): %v", what, kp.name, kp.kind.name, kp.err)
			continue
		}
		longest[kp.kind.name] = max(longest[kp.kind.name], kp.waited)
		p, err := s.n.Client.CoreV1().Pods(kp.kind.ns).Get(ctx, kp.name, metav1.GetOptions{})
		if err != nil {
			t.Error(err)
			continue
		}
		captured, cerr := at.captured(ctx, p)
		switch {
		case kp.kind.ambient && !captured:
			t.Errorf("%s: ambient pod %s/%s not captured: %v", what, p.Namespace, p.Name, cerr)
		case !kp.kind.ambient && captured:
			t.Errorf("%s: pod %s/%s, not ambient, captured", what, p.Namespace, p.Name)
		case kp.kind.ambient && !s.startedCapturedIn(t, at.records, p):
			startedOut++
		}
	}
	for _, k := range kinds {
		figure(t, fmt.Sprintf("%s-longest-wait-seconds-%s", what, k.name), longest[k.name].Round(100*time.Millisecond).Seconds())
	}
	figure(t, what+"-pods-created", len(pods))
	figure(t, what+"-ambient-pods-started-uncaptured", startedOut)
	if startedOut > 0 {
		t.Errorf("%s: %d ambient pods started uncaptured", what, startedOut)
	}
}

// deleteKinds deletes the pods of a step (their names are unique).
func (s *switchTest) deleteKinds(pods []kindPod) {
	ctx := context.Background()
	for _, kp := range pods {
		_ = s.n.Client.CoreV1().Pods(kp.kind.ns).Delete(ctx, kp.name, metav1.DeleteOptions{})
	}
}

// waitStandingBy waits until ambient-cni's agent on node is ready while
// istio-cni still holds the node's chain: it stands by.
func (s *switchTest) waitStandingBy(ctx context.Context, node string) error {
	return s.n.Poll(ctx, "ambient-cni standing by on "+node, func(ctx context.Context) (bool, error) {
		evs, err := s.n.Client.CoreV1().Events(ReleaseNamespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=StandingBy"})
		if err != nil {
			return false, err
		}
		agent, err := agentOn(ctx, s.n, node)
		if err != nil {
			return false, err
		}
		if !isReady(agent) {
			return false, fmt.Errorf("agent %s not ready: %s", agent.Name, podSummary(agent))
		}
		for _, e := range evs.Items {
			if e.InvolvedObject.Name == agent.Name {
				return true, nil
			}
		}
		return false, fmt.Errorf("no StandingBy Event on %s yet", agent.Name)
	})
}
