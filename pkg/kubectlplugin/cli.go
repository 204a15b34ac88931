package kubectlplugin

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// Usage is the help of `kubectl ambient-cni`.
const Usage = `usage: kubectl ambient-cni explain NAMESPACE/POD | POD -n NAMESPACE [flags]
       kubectl ambient-cni status NODE [flags]
       kubectl ambient-cni preflight -f ISTIO_CNI_VALUES [flags]

Asks ambient-cni's node agent on the pod's node (its DaemonSet pod there,
through the API server's pods/exec) and prints its answer:

  explain   why the pod is or is not captured: the verdict, what the agent
            checked (policy, its state for the pod, the pod's rules verified
            just now, its network namespace, its annotation), the problems
            and what to do
  status    the node's agent: ready or not (and why), ztunnel connections,
            pod counts, and every pod of the node that needs attention
  preflight before the switch from istio-cni, changing nothing: the
            values file through the chart (helm template), istio-cni's
            version and mode as it runs, what would stop the switch, and
            the exact plan; exits non-zero on a blocker

flags:
  -o, --output FORMAT      text (default) or json (the agent's report as is,
                           with the agent asked)
  -n, --namespace NS       the pod's namespace when POD has none (default:
                           the kubeconfig context's)
  --agent-namespace NS     where ambient-cni is installed (default istio-system)
  --kubeconfig FILE        kubeconfig (default: $KUBECONFIG, ~/.kube/config)
  --context NAME           kubeconfig context
  -f, --values FILE        preflight: the istio-cni values file
  --chart DIR              preflight: ambient-cni's chart (default
                           ./deploy/charts/ambient-cni)
  --istio-namespace NS     preflight: istio-cni's namespace (default
                           istio-system); ambient-cni is installed there
  --istio-daemonset NAME   preflight: istio-cni's DaemonSet (istio-cni-node)
  --image-repository R, --image-tag T
                           preflight: ambient-cni's image, for the plan
  --version                print the version

RBAC: get pods in the pod's namespace; list pods, and get and create
pods/exec, in the agent's namespace (docs/troubleshooting.md).
`

// Options are the parsed command line.
type Options struct {
	// Verb is explain or status; Target is NAMESPACE/POD, POD or NODE.
	Verb, Target              string
	Output                    string
	Namespace, AgentNamespace string
	Kubeconfig, Context       string
	// Preflight's.
	Values, Chart, IstioNamespace, IstioDaemonSet string
	ImageRepository, ImageTag                     string
}

// ErrUsage is a command line that is not one of Usage's.
var ErrUsage = errors.New("usage")

// ParseArgs reads the command line; flags may come before or after the
// verb and its argument (as kubectl's do).
func ParseArgs(args []string, stderr io.Writer) (Options, error) {
	o := Options{Output: "text", AgentNamespace: DefaultAgentNamespace}
	fs := flag.NewFlagSet("kubectl ambient-cni", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { _, _ = io.WriteString(stderr, Usage) }
	for _, n := range []string{"o", "output"} {
		fs.StringVar(&o.Output, n, o.Output, "text or json")
	}
	for _, n := range []string{"n", "namespace"} {
		fs.StringVar(&o.Namespace, n, "", "the pod's namespace")
	}
	fs.StringVar(&o.AgentNamespace, "agent-namespace", o.AgentNamespace, "where ambient-cni is installed")
	for _, n := range []string{"f", "values"} {
		fs.StringVar(&o.Values, n, "", "the istio-cni values file")
	}
	fs.StringVar(&o.Chart, "chart", "", "ambient-cni's chart")
	fs.StringVar(&o.IstioNamespace, "istio-namespace", "", "istio-cni's namespace")
	fs.StringVar(&o.IstioDaemonSet, "istio-daemonset", "", "istio-cni's DaemonSet")
	fs.StringVar(&o.ImageRepository, "image-repository", "", "ambient-cni's image repository")
	fs.StringVar(&o.ImageTag, "image-tag", "", "ambient-cni's image tag")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "kubeconfig file")
	fs.StringVar(&o.Context, "context", "", "kubeconfig context")
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return o, err
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(pos) == 1 && pos[0] == "preflight" {
		if o.Values == "" {
			return o, errors.New("preflight: -f ISTIO_CNI_VALUES is required")
		}
		o.Verb = pos[0]
		for _, d := range []struct {
			v   *string
			def string
		}{
			{&o.Chart, PageParams.Chart}, {&o.IstioNamespace, PageParams.Namespace}, {&o.IstioDaemonSet, PageParams.DaemonSet},
		} {
			if *d.v == "" {
				*d.v = d.def
			}
		}
		return o, nil
	}
	if len(pos) != 2 || (pos[0] != "explain" && pos[0] != "status") || pos[1] == "" {
		fs.Usage()
		return o, ErrUsage
	}
	if o.Output != "text" && o.Output != "json" {
		return o, fmt.Errorf("--output %q: want text or json", o.Output)
	}
	o.Verb, o.Target = pos[0], pos[1]
	if o.Verb == "status" && strings.Contains(o.Target, "/") {
		return o, fmt.Errorf("status %q: want a node name", o.Target)
	}
	return o, nil
}

// Run runs the plugin with the command line args.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := ParseArgs(args, stderr)
	if err != nil {
		return err
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = o.Kubeconfig
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: o.Context})
	cfg, err := cc.ClientConfig()
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	cfg.UserAgent = "kubectl-ambient_cni"
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	c := &Client{Kube: kube, Config: cfg, AgentNamespace: o.AgentNamespace}
	switch o.Verb {
	case "preflight":
		p := &Preflight{
			Kube: kube, Namespace: o.IstioNamespace, DaemonSet: o.IstioDaemonSet,
			ValuesFile: o.Values, Chart: o.Chart, ImageRepository: o.ImageRepository, ImageTag: o.ImageTag,
			Render: HelmTemplate(o.Kubeconfig, o.Context), FindNAD: FindIstioNAD(kube),
		}
		r, err := p.Run(ctx)
		if err != nil {
			return err
		}
		if err := RenderPreflight(stdout, r); err != nil {
			return err
		}
		if r.Blocked() {
			return ErrBlocked
		}
		return nil
	case "explain":
		ns, name, ok := strings.Cut(o.Target, "/")
		if !ok {
			ns, name = o.Namespace, o.Target
			if ns == "" {
				if ns, _, err = cc.Namespace(); err != nil {
					return fmt.Errorf("kubeconfig namespace: %w", err)
				}
			}
		}
		if ns == "" || name == "" || strings.Contains(name, "/") {
			return fmt.Errorf("explain %q: want NAMESPACE/POD", o.Target)
		}
		a, err := c.Explain(ctx, ns, name)
		if err != nil {
			return err
		}
		if o.Output == "json" {
			return RenderJSON(stdout, a)
		}
		return RenderPod(stdout, *a)
	default:
		a, err := c.Status(ctx, o.Target)
		if err != nil {
			return err
		}
		if o.Output == "json" {
			return RenderJSON(stdout, a)
		}
		return RenderNode(stdout, *a)
	}
}
