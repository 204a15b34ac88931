package kubectlplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"sort"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// ErrBlocked is a preflight that found something that would stop the
// switch: nothing should be changed before it is dealt with.
var ErrBlocked = errors.New("preflight: the switch would not go through")

// Preflight checks, before anything changes, that the switch from
// istio-cni can go through, and says how (kubectl ambient-cni preflight).
type Preflight struct {
	Kube kubernetes.Interface
	// Namespace is istio-cni's (and so ambient-cni's) namespace.
	Namespace string
	// DaemonSet is istio-cni's DaemonSet.
	DaemonSet string
	// ValuesFile is the istio-cni values file; Chart ambient-cni's chart.
	ValuesFile, Chart string
	// ImageRepository and ImageTag are ambient-cni's image (empty: the
	// page's variables).
	ImageRepository, ImageTag string
	// Render renders the chart with the values file and the takeover on
	// (helm template): the chart's own validation of the values.
	Render func(ctx context.Context, args []string) error
	// FindNAD, when set, tells whether Multus's NetworkAttachmentDefinition
	// for istio-cni exists.
	FindNAD func(ctx context.Context) (bool, error)
}

// Finding is one thing preflight found: a blocker stops the switch.
type Finding struct {
	Blocker bool
	Text    string
}

// PreflightResult is what preflight found and the plan it would follow.
type PreflightResult struct {
	IstioVersion string
	Findings     []Finding
	Plan         []PlanStep
}

// Blocked reports whether any finding stops the switch.
func (r *PreflightResult) Blocked() bool {
	for _, f := range r.Findings {
		if f.Blocker {
			return true
		}
	}
	return false
}

// Run reads the values file and the cluster (read only) and makes the plan.
func (p *Preflight) Run(ctx context.Context) (*PreflightResult, error) {
	r := &PreflightResult{}
	block := func(format string, a ...any) {
		r.Findings = append(r.Findings, Finding{Blocker: true, Text: fmt.Sprintf(format, a...)})
	}
	note := func(format string, a ...any) {
		r.Findings = append(r.Findings, Finding{Text: fmt.Sprintf(format, a...)})
	}
	params := PlanParams{
		Namespace: p.Namespace, IstioRelease: "istio-cni", DaemonSet: p.DaemonSet,
		ValuesFile: p.ValuesFile, Chart: p.Chart,
		ImageRepository: p.ImageRepository, ImageTag: p.ImageTag,
	}
	if params.ImageRepository == "" {
		params.ImageRepository = PageParams.ImageRepository
	}
	if params.ImageTag == "" {
		params.ImageTag = PageParams.ImageTag
	}

	// The values, as the plan reads them, then as the chart does.
	v, err := ReadIstioValues(p.ValuesFile)
	if err != nil {
		block("%v", err)
	} else {
		checkValues(v, block)
		if p.Render != nil {
			args := []string{"template", "ambient-cni", p.Chart, "-n", p.Namespace, "-f", p.ValuesFile,
				"--set", "migration.fromIstioCNI.enabled=true"}
			if p.ImageRepository != "" {
				args = append(args, "--set", "image.repository="+p.ImageRepository)
			}
			if p.ImageTag != "" {
				args = append(args, "--set", "image.tag="+p.ImageTag)
			}
			if err := p.Render(ctx, args); err != nil {
				block("the chart refuses the values file: %v", err)
			}
		}
	}

	// istio-cni as it runs.
	ds, err := p.Kube.AppsV1().DaemonSets(p.Namespace).Get(ctx, p.DaemonSet, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		elsewhere := p.findIstioCNI(ctx)
		if elsewhere != "" {
			block("istio-cni's DaemonSet is %s, not %s/%s: run preflight with --istio-namespace and --istio-daemonset naming it (ambient-cni is installed in its namespace)", elsewhere, p.Namespace, p.DaemonSet)
		} else {
			block("no istio-cni DaemonSet %s/%s, nor any DaemonSet labelled app.kubernetes.io/name=istio-cni: nothing to switch from (install ambient-cni as docs/deploy.md says)", p.Namespace, p.DaemonSet)
		}
		return p.finish(r, params), nil
	case err != nil:
		return nil, fmt.Errorf("read istio-cni's DaemonSet %s/%s: %w", p.Namespace, p.DaemonSet, err)
	}
	if ds.DeletionTimestamp != nil {
		block("istio-cni's DaemonSet %s/%s is being deleted: istio-cni is releasing every pod; let it finish, then install ambient-cni", p.Namespace, p.DaemonSet)
	}
	if rel := ds.Annotations["meta.helm.sh/release-name"]; rel != "" {
		params.IstioRelease = rel
	}
	r.IstioVersion = istioVersion(ds)
	params.IstioVersion = r.IstioVersion
	if r.IstioVersion == "" {
		params.IstioVersion = PageParams.IstioVersion
		note("istio-cni's version cannot be read from its DaemonSet (no app.kubernetes.io/version label, no image tag): set ISTIO_VERSION to its chart's version")
	} else if !atLeast(r.IstioVersion, 1, 28, 4) {
		block("istio-cni %s has no ambient.enableAmbientDetectionRetry (1.28.4 and later): its plugin would let a pod it cannot look up start outside the mesh while its agent leaves; upgrade istio-cni first", r.IstioVersion)
	}
	if runDir := istioRunDir(ds); runDir != "" && runDir != "/var/run/istio-cni" {
		params.RunDir = runDir
	}
	if ds.Spec.Template.Spec.NodeSelector[SwitchLabel] != "" {
		note("istio-cni's DaemonSet already selects nodes by %s (a switch under way): the steps before are done when every node is labelled", SwitchLabel)
	}
	managedBy(ds, note)

	cm, err := p.Kube.CoreV1().ConfigMaps(p.Namespace).Get(ctx, "istio-cni-config", metav1.GetOptions{})
	switch {
	case err == nil:
		d := cm.Data
		if d["AMBIENT_ENABLED"] == "false" {
			block("istio-cni runs for sidecars only (AMBIENT_ENABLED false): ambient-cni has no sidecar mode; keep istio-cni")
		}
		if d["CHAINED_CNI_PLUGIN"] == "false" {
			block("istio-cni runs as a Multus network (CHAINED_CNI_PLUGIN false): the takeover replaces a chained istio-cni only")
		}
		if d["ISTIO_OWNED_CNI_CONFIG"] == "true" {
			note("istio-cni writes its own conflist (istioOwnedCNIConfig, %s), a copy of the primary's: on each node the takeover chains ours for the primary's and then removes that copy", orDefault(d["ISTIO_OWNED_CNI_CONF_FILENAME"], "02-istio-cni.conflist"))
		}
		params.NeedRetry = d["ENABLE_AMBIENT_DETECTION_RETRY"] != "true"
	case apierrors.IsNotFound(err):
		note("no ConfigMap istio-cni-config in %s: istio-cni's mode read from the values file only", p.Namespace)
		params.NeedRetry = v.DetectionRetry == nil || !*v.DetectionRetry
	default:
		return nil, fmt.Errorf("read istio-cni's ConfigMap: %w", err)
	}
	if p.Namespace == "kube-system" {
		note("istio-cni runs in kube-system: ambient-cni goes there too (its agent reads istio-cni's DaemonSet in its own namespace)")
	}
	if p.FindNAD != nil {
		if found, err := p.FindNAD(ctx); err != nil {
			note("cannot tell whether Multus's NetworkAttachmentDefinition default/istio-cni exists: %v", err)
		} else if found {
			block("Multus's NetworkAttachmentDefinition default/istio-cni exists (istio-cni's provider multus): the takeover replaces a chained istio-cni only")
		}
	}
	ours, err := p.Kube.AppsV1().DaemonSets(p.Namespace).List(ctx, metav1.ListOptions{LabelSelector: AgentSelector})
	if err != nil {
		return nil, fmt.Errorf("look for ambient-cni: %w", err)
	}
	if len(ours.Items) > 0 {
		note("ambient-cni is installed already (DaemonSet %s): skip its helm install; its takeover must be on", ours.Items[0].Name)
	}
	nodes, err := p.Kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	for _, n := range nodes.Items {
		params.Nodes = append(params.Nodes, n.Name)
	}
	sort.Strings(params.Nodes)
	return p.finish(r, params), nil
}

func (p *Preflight) finish(r *PreflightResult, params PlanParams) *PreflightResult {
	r.Plan = Plan(params)
	return r
}

// findIstioCNI names istio-cni's DaemonSet in another namespace, if any.
func (p *Preflight) findIstioCNI(ctx context.Context) string {
	l, err := p.Kube.AppsV1().DaemonSets("").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=istio-cni"})
	if err != nil || len(l.Items) == 0 {
		return ""
	}
	return l.Items[0].Namespace + "/" + l.Items[0].Name
}

// checkValues blocks on what the takeover cannot switch from.
func checkValues(v IstioValues, block func(string, ...any)) {
	if v.AmbientEnabled != nil && !*v.AmbientEnabled {
		block("values: ambient.enabled is false (istio-cni for sidecars only): ambient-cni has no sidecar mode")
	}
	if (v.Chained != nil && !*v.Chained) || v.Provider == "multus" {
		block("values: istio-cni as a Multus network (chained false or provider multus): the takeover replaces a chained istio-cni only")
	}
	if v.OwnedConfig {
		block("values: istioOwnedCNIConfig is true: turn it off on istio-cni first (set cni.ownedConfig on ours instead)")
	}
}

// istioVersion is istio-cni's chart version: its DaemonSet's
// app.kubernetes.io/version label, else its image's tag.
func istioVersion(ds *appsv1.DaemonSet) string {
	if v := ds.Labels["app.kubernetes.io/version"]; v != "" {
		return v
	}
	for _, c := range ds.Spec.Template.Spec.Containers {
		img := c.Image
		if i := strings.LastIndexByte(img, '@'); i >= 0 {
			img = img[:i]
		}
		if i := strings.LastIndexByte(img, ':'); i >= 0 && !strings.Contains(img[i:], "/") {
			return strings.TrimSuffix(strings.TrimSuffix(img[i+1:], "-distroless"), "-debug")
		}
	}
	return ""
}

// atLeast reports whether version v (1.30.3, 1.31.0-rc.0) is at least
// major.minor.patch; an unparsable one is not.
func atLeast(v string, major, minor, patch int) bool {
	core, _, _ := strings.Cut(strings.TrimPrefix(v, "v"), "-")
	f := strings.Split(core, ".")
	if len(f) < 2 {
		return false
	}
	want := []int{major, minor, patch}
	for i := range 3 {
		n := 0
		if i < len(f) {
			var err error
			if n, err = strconv.Atoi(f[i]); err != nil {
				return false
			}
		}
		if n != want[i] {
			return n > want[i]
		}
	}
	return true
}

// istioRunDir is the host directory istio-cni's pods mount at its run
// directory (its chart's cni-socket-dir volume).
func istioRunDir(ds *appsv1.DaemonSet) string {
	for _, vol := range ds.Spec.Template.Spec.Volumes {
		if vol.Name == "cni-socket-dir" && vol.HostPath != nil {
			return vol.HostPath.Path
		}
	}
	return ""
}

// managedBy says what reverts a kubectl patch of istio-cni's DaemonSet and
// where the nodeSelector goes instead.
func managedBy(ds *appsv1.DaemonSet, note func(string, ...any)) {
	for _, o := range ds.OwnerReferences {
		if o.Kind == "IstioCNI" {
			note("istio-cni is managed by the Sail operator (IstioCNI %s): its chart values have no nodeSelector, and Sail reconciles the DaemonSet; patch it with Sail's reconciliation of IstioCNI paused, and keep it paused until istio-cni is removed", o.Name)
			return
		}
	}
	l, a := ds.Labels, ds.Annotations
	switch {
	case a["argocd.argoproj.io/tracking-id"] != "" || l["argocd.argoproj.io/instance"] != "":
		note("istio-cni is managed by Argo CD: a kubectl patch is reverted by self-heal; add the nodeSelector as a patch in the Application's source (kustomize patches over the chart) or pause self-heal for the switch")
	case l["helm.toolkit.fluxcd.io/name"] != "" || l["kustomize.toolkit.fluxcd.io/name"] != "":
		note("istio-cni is managed by Flux: add the nodeSelector through the HelmRelease's postRenderers (a kustomize patch), or suspend it for the switch")
	case l["install.operator.istio.io/owning-resource"] != "" && l["install.operator.istio.io/owning-resource"] != "unknown":
		note("istio-cni is managed by istioctl (IstioOperator %s): set the nodeSelector in components.cni.k8s.nodeSelector and run istioctl install instead of the kubectl patch", l["install.operator.istio.io/owning-resource"])
	}
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

// RenderPreflight prints the findings and the plan.
func RenderPreflight(w io.Writer, r *PreflightResult) error {
	var b strings.Builder
	if r.IstioVersion != "" {
		fmt.Fprintf(&b, "istio-cni %s\n", r.IstioVersion)
	}
	for _, f := range r.Findings {
		tag := "note"
		if f.Blocker {
			tag = "BLOCKER"
		}
		fmt.Fprintf(&b, "%s: %s\n", tag, f.Text)
	}
	if r.Blocked() {
		b.WriteString("\nNothing was changed. Deal with every BLOCKER, then run preflight again.\n")
		_, err := io.WriteString(w, b.String())
		return err
	}
	b.WriteString("\nThe plan (docs/migrating-from-istio-cni.md says why each step is safe):\n")
	for i, s := range r.Plan {
		fmt.Fprintf(&b, "\n%d. %s\n\n%s", i+1, s.Title, s.Commands)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// HelmTemplate renders with the helm on PATH, as the user's helm install
// would (its client-side validation: the chart's schema and its checks of
// Istio's values); the error carries helm's message.
func HelmTemplate(kubeconfig, kubeContext string) func(ctx context.Context, args []string) error {
	return func(ctx context.Context, args []string) error {
		if kubeconfig != "" {
			args = append(args, "--kubeconfig", kubeconfig)
		}
		if kubeContext != "" {
			args = append(args, "--kube-context", kubeContext)
		}
		cmd := exec.CommandContext(ctx, "helm", args...)
		var stderr strings.Builder
		cmd.Stdout, cmd.Stderr = io.Discard, &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
		}
		return nil
	}
}

// FindIstioNAD looks for the NetworkAttachmentDefinition istio-cni's chart
// makes with provider multus (default/istio-cni); a cluster without
// Multus's API has none.
func FindIstioNAD(kube kubernetes.Interface) func(ctx context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) {
		err := kube.CoreV1().RESTClient().Get().
			AbsPath("/apis/k8s.cni.cncf.io/v1/namespaces/default/network-attachment-definitions/istio-cni").
			Do(ctx).Error()
		switch {
		case err == nil:
			return true, nil
		case apierrors.IsNotFound(err):
			return false, nil
		}
		return false, err
	}
}
