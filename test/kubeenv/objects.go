package kubeenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/ambient-cni/ambient-cni/internal/testnet"
)

// RBACPath is the shipped RBAC of the node agent, relative to the
// repository root: one source of truth for the chart and the tests.
const RBACPath = "deploy/rbac/clusterrole.yaml"

// FieldManager is the server-side apply field manager Apply uses by default.
const FieldManager = "kubeenv"

// ShippedRBAC returns the contents of RBACPath, for ServiceAccountClient.
func ShippedRBAC(t testing.TB) []byte {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, RBACPath))
	if err != nil {
		t.Fatalf("read shipped RBAC: %v", err)
	}
	return b
}

// bootstrap creates what kube-controller-manager would, so that pods can be
// created in the default namespace (the ServiceAccount admission plugin
// wants the default ServiceAccount to exist).
func (e *Env) bootstrap(ctx context.Context) error {
	return e.ensureServiceAccount(ctx, metav1.NamespaceDefault, "default")
}

func (e *Env) ensureServiceAccount(ctx context.Context, namespace, name string) error {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace}}
	_, err := e.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create serviceaccount %s/%s: %w", namespace, name, err)
	}
	return nil
}

// CreateNamespace creates a namespace with the given labels, plus its
// default ServiceAccount (no controller manager runs here to create it, and
// pods cannot be created without it). An empty name picks a random one. The
// namespace is not deleted afterwards: nothing here would finalize the
// deletion, and the whole Env goes away with its test or package. In a
// shared Env, give every test its own namespace names.
func (e *Env) CreateNamespace(t testing.TB, name string, labels map[string]string) *corev1.Namespace {
	t.Helper()
	if name == "" {
		name = testnet.RandName("kubeenv-", 8)
	}
	ctx := context.Background()
	ns, err := e.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	if err := e.ensureServiceAccount(ctx, name, "default"); err != nil {
		t.Fatal(err)
	}
	return ns
}

// ServiceAccountClient creates the ServiceAccount namespace/name (and the
// namespace if it does not exist), applies the RBAC objects in rbacYAML
// (ClusterRoles and Roles, and any bindings it holds; a Role without a
// namespace lands in the ServiceAccount's), binds every ClusterRole and Role
// in it to the ServiceAccount, waits until the authorizer grants the first
// verb of every rule, and returns a config and client that authenticate with
// a token from the TokenRequest API. Code run with this client has exactly
// the permissions in rbacYAML, as the shipped agent would.
func (e *Env) ServiceAccountClient(t testing.TB, namespace, name string, rbacYAML []byte) (*rest.Config, kubernetes.Interface) {
	t.Helper()
	cfg, err := e.serviceAccountConfig(context.Background(), namespace, name, rbacYAML)
	if err != nil {
		t.Fatalf("serviceaccount client %s/%s: %v", namespace, name, err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("serviceaccount client %s/%s: %v", namespace, name, err)
	}
	return cfg, cs
}

func (e *Env) serviceAccountConfig(ctx context.Context, namespace, name string, rbacYAML []byte) (*rest.Config, error) {
	objs, err := ParseObjects(rbacYAML)
	if err != nil {
		return nil, err
	}
	for _, o := range objs {
		if o.GroupVersionKind().Group != rbacv1.GroupName {
			return nil, fmt.Errorf("%s %s is not an RBAC object", o.GetKind(), o.GetName())
		}
	}
	_, err = e.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create namespace %s: %w", namespace, err)
	}
	if err := e.ensureServiceAccount(ctx, namespace, name); err != nil {
		return nil, err
	}
	if _, err := e.Apply(ctx, rbacYAML, ApplyOptions{Namespace: namespace}); err != nil {
		return nil, err
	}

	subject := []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: namespace, Name: name}}
	var checks []authorizationv1.ResourceAttributes
	for _, o := range objs {
		switch o.GetKind() {
		case "ClusterRole":
			var cr rbacv1.ClusterRole
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &cr); err != nil {
				return nil, fmt.Errorf("decode clusterrole %s: %w", o.GetName(), err)
			}
			_, err := e.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: bindingName(cr.Name, namespace, name)},
				RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: cr.Name},
				Subjects:   subject,
			}, metav1.CreateOptions{})
			if err != nil && !apierrors.IsAlreadyExists(err) {
				return nil, fmt.Errorf("bind clusterrole %s: %w", cr.Name, err)
			}
			checks = append(checks, ruleChecks(cr.Rules, namespace)...)
		case "Role":
			var r rbacv1.Role
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &r); err != nil {
				return nil, fmt.Errorf("decode role %s: %w", o.GetName(), err)
			}
			ns := r.Namespace
			if ns == "" {
				ns = namespace
			}
			_, err := e.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: bindingName(r.Name, namespace, name), Namespace: ns},
				RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: r.Name},
				Subjects:   subject,
			}, metav1.CreateOptions{})
			if err != nil && !apierrors.IsAlreadyExists(err) {
				return nil, fmt.Errorf("bind role %s/%s: %w", ns, r.Name, err)
			}
			checks = append(checks, ruleChecks(r.Rules, ns)...)
		}
	}

	tr, err := e.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: new(int64(3 * 3600))},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("token request for %s/%s: %w", namespace, name, err)
	}
	cfg := &rest.Config{
		Host:            e.Config.Host,
		TLSClientConfig: rest.TLSClientConfig{CAData: e.ca.certPEM},
		BearerToken:     tr.Status.Token,
		QPS:             e.Config.QPS,
		Burst:           e.Config.Burst,
	}
	if err := waitAllowed(ctx, cfg, checks); err != nil {
		return nil, err
	}
	return cfg, nil
}

// bindingName is unique per role and ServiceAccount, so several test
// ServiceAccounts can share one Env.
func bindingName(role, namespace, sa string) string {
	return "kubeenv:" + role + ":" + namespace + ":" + sa
}

// ruleChecks turns each resource rule into one access check (its first
// group, resource and verb), enough to see the binding has taken effect.
func ruleChecks(rules []rbacv1.PolicyRule, namespace string) []authorizationv1.ResourceAttributes {
	var out []authorizationv1.ResourceAttributes
	for _, r := range rules {
		if len(r.Verbs) == 0 || len(r.Resources) == 0 || len(r.APIGroups) == 0 {
			continue
		}
		res, sub, _ := strings.Cut(r.Resources[0], "/")
		a := authorizationv1.ResourceAttributes{
			Namespace: namespace, Verb: r.Verbs[0], Group: r.APIGroups[0], Resource: res, Subresource: sub,
		}
		if len(r.ResourceNames) > 0 {
			a.Name = r.ResourceNames[0]
		}
		out = append(out, a)
	}
	return out
}

// waitAllowed polls self access reviews as cfg's user until every check is
// allowed: the RBAC authorizer sees new bindings through a watch, a moment
// after they are written.
func waitAllowed(ctx context.Context, cfg *rest.Config, checks []authorizationv1.ResourceAttributes) error {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, c := range checks {
		for {
			r, err := cs.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
				Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &c},
			}, metav1.CreateOptions{})
			if err == nil && r.Status.Allowed {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("permission %+v never granted (last error %v)", c, err)
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	return nil
}

// UserConfig returns a config that authenticates with a client certificate
// for user in groups, e.g. a kubelet identity ("system:node:<name>",
// "system:nodes"), which the Node authorizer then governs.
func (e *Env) UserConfig(user string, groups ...string) (*rest.Config, error) {
	cert, key, err := e.ca.client(user, groups...)
	if err != nil {
		return nil, err
	}
	return &rest.Config{
		Host:            e.Config.Host,
		TLSClientConfig: rest.TLSClientConfig{CAData: e.ca.certPEM, CertData: cert, KeyData: key},
		QPS:             e.Config.QPS,
		Burst:           e.Config.Burst,
	}, nil
}

// WriteKubeconfig writes cfg (certificate or token based) as a kubeconfig
// file, for running the agent as a separate process with --kubeconfig.
func WriteKubeconfig(cfg *rest.Config, path string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["kubeenv"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["kubeenv"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: cfg.CertData,
		ClientKeyData:         cfg.KeyData,
		Token:                 cfg.BearerToken,
	}
	kc.Contexts["kubeenv"] = &clientcmdapi.Context{Cluster: "kubeenv", AuthInfo: "kubeenv"}
	kc.CurrentContext = "kubeenv"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}

// ParseObjects decodes a multi-document YAML (or JSON) manifest into
// objects, skipping empty documents. Every object needs apiVersion and kind.
func ParseObjects(manifest []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifest), 4096)
	var out []*unstructured.Unstructured
	for i := 0; ; i++ {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("decode manifest document %d: %w", i, err)
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		if u.GetAPIVersion() == "" || u.GetKind() == "" {
			return nil, fmt.Errorf("manifest document %d has no apiVersion or kind", i)
		}
		out = append(out, u)
	}
}

// ApplyOptions tune Apply.
type ApplyOptions struct {
	// DryRun asks the server to run admission and validation but persist
	// nothing.
	DryRun bool
	// Namespace is used for namespaced objects that name none.
	// Empty: "default".
	Namespace string
	// FieldManager for server-side apply. Empty: FieldManager.
	FieldManager string
}

// Apply server-side applies every object of a manifest, in order, as the
// admin, and returns what the server answered. Namespaced objects need
// their namespace to exist already (with DryRun, a Namespace object in the
// same manifest is not created: create it with CreateNamespace first).
func (e *Env) Apply(ctx context.Context, manifest []byte, opts ApplyOptions) ([]*unstructured.Unstructured, error) {
	objs, err := ParseObjects(manifest)
	if err != nil {
		return nil, err
	}
	if opts.Namespace == "" {
		opts.Namespace = metav1.NamespaceDefault
	}
	if opts.FieldManager == "" {
		opts.FieldManager = FieldManager
	}
	po := metav1.PatchOptions{FieldManager: opts.FieldManager, Force: new(true)}
	if opts.DryRun {
		po.DryRun = []string{metav1.DryRunAll}
	}
	var out []*unstructured.Unstructured
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		mapping, err := e.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if meta.IsNoMatchError(err) {
			// A type registered since discovery was cached (a CRD).
			e.mapper.Reset()
			mapping, err = e.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		}
		if err != nil {
			return out, fmt.Errorf("%s %s: %w", gvk.Kind, o.GetName(), err)
		}
		ri := e.Dynamic.Resource(mapping.Resource)
		var res *unstructured.Unstructured
		body, err := o.MarshalJSON()
		if err != nil {
			return out, fmt.Errorf("encode %s %s: %w", gvk.Kind, o.GetName(), err)
		}
		if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
			ns := o.GetNamespace()
			if ns == "" {
				ns = opts.Namespace
			}
			res, err = ri.Namespace(ns).Patch(ctx, o.GetName(), types.ApplyPatchType, body, po)
			if err != nil {
				return out, fmt.Errorf("apply %s %s/%s: %w", gvk.Kind, ns, o.GetName(), err)
			}
		} else {
			res, err = ri.Patch(ctx, o.GetName(), types.ApplyPatchType, body, po)
			if err != nil {
				return out, fmt.Errorf("apply %s %s: %w", gvk.Kind, o.GetName(), err)
			}
		}
		out = append(out, res)
	}
	return out, nil
}

// ApplyDryRun server-side applies a manifest with dry run: the server runs
// defaulting, validation and admission on every object and persists none.
// Namespaced objects without a namespace are checked in "default".
func (e *Env) ApplyDryRun(ctx context.Context, manifest []byte) error {
	_, err := e.Apply(ctx, manifest, ApplyOptions{DryRun: true})
	return err
}

// RoleRules collects the rules of every ClusterRole and every Role in a
// manifest (other kinds are ignored), so a test can check that a rendered
// chart grants exactly what ShippedRBAC does.
func RoleRules(manifest []byte) (cluster, namespaced []rbacv1.PolicyRule, err error) {
	objs, err := ParseObjects(manifest)
	if err != nil {
		return nil, nil, err
	}
	for _, o := range objs {
		if o.GroupVersionKind().Group != rbacv1.GroupName {
			continue
		}
		switch o.GetKind() {
		case "ClusterRole":
			var cr rbacv1.ClusterRole
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &cr); err != nil {
				return nil, nil, fmt.Errorf("decode clusterrole %s: %w", o.GetName(), err)
			}
			cluster = append(cluster, cr.Rules...)
		case "Role":
			var r rbacv1.Role
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &r); err != nil {
				return nil, nil, fmt.Errorf("decode role %s: %w", o.GetName(), err)
			}
			namespaced = append(namespaced, r.Rules...)
		}
	}
	return cluster, namespaced, nil
}
