package kubectlplugin

import (
	"fmt"
	"os"
	"regexp"
	"strings"
)

// SwitchLabel is the node label the switch moves istio-cni's DaemonSet
// with: its nodeSelector asks for "on"; a node labelled "off" is left by
// istio-cni's pod, which, its DaemonSet still present, leaves its plugin
// chained and its pods captured (Istio takes it for an upgrade), and
// ambient-cni's agent there takes over.
const SwitchLabel = "ambient-cni.io/istio-cni"

// PlanParams are what the switch's commands are made of. Each is a shell
// word as it is written: a plain value, or a quoted variable ("$NODE") on
// the migration page.
type PlanParams struct {
	// Namespace holds istio-cni's release, and ambient-cni's goes there
	// too (its agent reads istio-cni's DaemonSet in its own namespace).
	Namespace string
	// IstioRelease is istio-cni's Helm release, IstioVersion its chart's
	// version (kept by the upgrade of step 1).
	IstioRelease, IstioVersion string
	// DaemonSet is istio-cni's DaemonSet.
	DaemonSet string
	// ValuesFile is the istio-cni values file, Chart ambient-cni's chart.
	ValuesFile, Chart string
	// ImageRepository and ImageTag are ambient-cni's image.
	ImageRepository, ImageTag string
	// RunDir is istio-cni's run directory when not Istio's default.
	RunDir string
	// NeedRetry: istio-cni's enableAmbientDetectionRetry is not on yet.
	NeedRetry bool
	// Nodes are the nodes, in the order they switch; empty writes one
	// block for "$NODE".
	Nodes []string
}

// PageParams are the parameters the migration page's commands are
// written with (TestMigrationPageIsThePlan).
var PageParams = PlanParams{
	Namespace: "istio-system", IstioRelease: "istio-cni", IstioVersion: `"$ISTIO_VERSION"`,
	DaemonSet: "istio-cni-node", ValuesFile: "istio-cni-values.yaml", Chart: "./deploy/charts/ambient-cni",
	ImageRepository: `"$IMAGE_REPOSITORY"`, ImageTag: `"$IMAGE_TAG"`, NeedRetry: true,
}

// PlanStep is one step of the switch: a title and its shell commands.
type PlanStep struct {
	Title    string
	Commands string
}

// shellWord matches what needs no quoting in a command, or a quoted
// variable as the page writes it.
var shellWord = regexp.MustCompile(`^([A-Za-z0-9_./:@=,+-]+|"\$[A-Z_]+")$`)

// word quotes s for the shell unless it is a plain word.
func word(s string) string {
	if shellWord.MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Plan is the switch, in order: istio-cni made to fail closed (when it is
// not yet), its DaemonSet moved to labelled nodes (one rolling upgrade of
// istio-cni, Istio's own, pods kept captured), ambient-cni installed on
// every node where it stands by, then node by node istio-cni leaves and
// ambient-cni takes over, and last istio-cni's release goes and the
// takeover is turned off.
func Plan(p PlanParams) []PlanStep {
	ns, ds := word(p.Namespace), word(p.DaemonSet)
	var steps []PlanStep
	if p.NeedRetry {
		steps = append(steps, PlanStep{"istio-cni fails closed", fmt.Sprintf(
			"helm upgrade %s istio/cni -n %s --version %s --reuse-values \\\n  --set ambient.enableAmbientDetectionRetry=true\n",
			word(p.IstioRelease), ns, word(p.IstioVersion))})
	}
	steps = append(steps, PlanStep{"istio-cni's DaemonSet on labelled nodes", fmt.Sprintf(
		"kubectl label nodes --all %s=on --overwrite\n"+
			"kubectl -n %s patch daemonset %s \\\n  -p '{\"spec\":{\"template\":{\"spec\":{\"nodeSelector\":{\"%s\":\"on\"}}}}}'\n"+
			"kubectl -n %s rollout status daemonset/%s --timeout=10m\n",
		SwitchLabel, ns, ds, SwitchLabel, ns, ds)})
	install := fmt.Sprintf("helm install ambient-cni %s -n %s \\\n  -f %s \\\n  --set image.repository=%s --set image.tag=%s \\\n  --set migration.fromIstioCNI.enabled=true",
		word(p.Chart), ns, word(p.ValuesFile), word(p.ImageRepository), word(p.ImageTag))
	if p.RunDir != "" {
		install += " \\\n  --set migration.fromIstioCNI.runDir=" + word(p.RunDir)
	}
	if p.DaemonSet != PageParams.DaemonSet {
		install += " \\\n  --set migration.fromIstioCNI.daemonSet=" + ds
	}
	install += " --wait --timeout 10m\n" + fmt.Sprintf("kubectl -n %s rollout status daemonset/ambient-cni --timeout=10m\n", ns)
	steps = append(steps, PlanStep{"ambient-cni on every node, standing by", install})
	nodes := p.Nodes
	if len(nodes) == 0 {
		nodes = []string{`"$NODE"`}
	}
	for _, n := range nodes {
		// The pod by name: kubectl wait fails on a selector that
		// matches nothing.
		steps = append(steps, PlanStep{"node " + strings.Trim(n, `"`) + " switches", fmt.Sprintf(
			"pod=$(kubectl -n %s get pod -l app.kubernetes.io/name=istio-cni \\\n  --field-selector spec.nodeName=%s -o name)\n"+
				"kubectl label node %s %s=off --overwrite\n"+
				"[ -z \"$pod\" ] || kubectl -n %s wait --for=delete \"$pod\" --timeout=5m\n",
			ns, word(n), word(n), SwitchLabel, ns)})
	}
	steps = append(steps, PlanStep{"istio-cni's release goes, the takeover is turned off", fmt.Sprintf(
		"helm uninstall %s -n %s\n"+
			"helm upgrade ambient-cni %s -n %s --reuse-values \\\n  --set migration.fromIstioCNI.enabled=false --wait --timeout 10m\n"+
			"kubectl -n %s rollout status daemonset/ambient-cni --timeout=10m\n"+
			"kubectl label nodes --all %s-\n",
		word(p.IstioRelease), ns, word(p.Chart), ns, ns, SwitchLabel)})
	return steps
}

// PageSwitchSection is the migration page's section whose sh blocks are
// the plan for PageParams.
const PageSwitchSection = "## The switch, node by node"

// PageBlocks returns the fenced sh blocks of a markdown file's section
// (from its heading line to the next heading of the same level), each
// with its lines' common indentation removed.
func PageBlocks(path, heading string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	level := heading[:strings.IndexByte(heading, ' ')+1]
	var blocks []string
	in, found := false, false
	var cur strings.Builder
	indent := ""
	for _, line := range strings.Split(string(b), "\n") {
		if !in && strings.HasPrefix(line, "#") {
			if found && strings.HasPrefix(line, level) {
				break
			}
			if line == heading {
				found = true
			}
			continue
		}
		if !found {
			continue
		}
		trimmed := strings.TrimLeft(line, " ")
		switch {
		case !in && trimmed == "```sh":
			in, indent = true, line[:len(line)-len(trimmed)]
			cur.Reset()
		case in && trimmed == "```":
			in = false
			blocks = append(blocks, cur.String())
		case in:
			cur.WriteString(strings.TrimPrefix(line, indent) + "\n")
		}
	}
	if !found {
		return nil, fmt.Errorf("%s: no section %q", path, heading)
	}
	return blocks, nil
}
