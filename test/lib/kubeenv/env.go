// Package kubeenv runs a real control plane for tests: etcd and
// kube-apiserver, built from the Go module proxy by hack/kube-tools.sh and
// started on loopback with random ports, throwaway certificates and a
// temporary data directory. Tests get an admin client, and clients that
// authenticate as a ServiceAccount bound to exactly the RBAC the project
// ships, so the agent is proven to work with its real permissions.
//
// One Env per test: Start(t). One Env per package: a Shared in TestMain.
// Without the binaries, tests skip (or fail under CI=true) with the command
// that builds them.
package kubeenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
)

// Options tune an Env. The zero value is what tests normally want.
type Options struct {
	// Dir holds data, certificates and logs. Empty: a temporary directory
	// that Stop removes.
	Dir string
	// APIServerArgs are appended to kube-apiserver's flags (a later flag
	// wins), e.g. feature gates.
	APIServerArgs []string
	// ReadyTimeout bounds the wait for /readyz. Zero: two minutes, generous
	// for a loaded CI machine; it is normally ready in a few seconds.
	ReadyTimeout time.Duration
	// Logf, when set, receives progress lines (tests pass t.Logf).
	Logf func(format string, args ...any)
	// KubeletClient gives the apiserver a client certificate of the CA for
	// kubelets (logs, exec) that authenticate clients against it, and has
	// it reach them by their InternalIP (a node name may not resolve).
	KubeletClient bool
	// ListenAll binds the apiserver to every address, not only loopback,
	// and names ServingIPs in its serving certificate: for clients in
	// network namespaces of their own (simulated nodes) that reach it
	// through an address of the caller's namespace.
	ListenAll  bool
	ServingIPs []net.IP
}

// ServiceCIDR is the service cluster IP range the apiserver is given.
const ServiceCIDR = "10.96.0.0/12"

// Env is a running etcd + kube-apiserver pair.
type Env struct {
	// Config authenticates as an admin (group system:masters) with a client
	// certificate. Copy it (rest.CopyConfig) before changing it.
	Config *rest.Config
	// Client and Dynamic are admin clients built from Config.
	Client  kubernetes.Interface
	Dynamic dynamic.Interface
	// Dir holds etcd's data, the certificates and the logs
	// (etcd.log, kube-apiserver.log).
	Dir string
	// StartTime is how long the Env took from start until /readyz was ok.
	StartTime time.Duration
	// CAFile is the cluster CA certificate (PEM) and ServiceAccountKeyFile
	// the key that signs ServiceAccount tokens, for control-plane
	// components started beside the apiserver (kube-controller-manager).
	CAFile, ServiceAccountKeyFile string

	ca        *authority
	etcd      *childproc.Proc
	apiserver *childproc.Proc
	// apiBin and apiArgs restart kube-apiserver after StopAPIServer.
	apiBin    string
	apiArgs   []string
	apiMu     sync.Mutex
	removeDir bool
	stopOnce  sync.Once
	mapper    *restmapper.DeferredDiscoveryRESTMapper
}

// Start starts an Env for one test and stops it when the test ends. It skips
// the test (fails it under CI=true) when the binaries are not built.
func Start(t testing.TB) *Env {
	t.Helper()
	RequireTool(t, Etcd)
	RequireTool(t, KubeAPIServer)
	env, err := Launch(context.Background(), Options{Dir: t.TempDir(), Logf: t.Logf})
	if err != nil {
		t.Fatalf("start kube-apiserver: %v", err)
	}
	t.Cleanup(env.Stop)
	t.Logf("kubeenv: etcd + kube-apiserver ready in %v at %s", env.StartTime.Round(time.Millisecond), env.Config.Host)
	return env
}

// Launch starts etcd and kube-apiserver and waits until the apiserver
// reports ready. The caller must call Stop. Errors wrap ErrToolMissing when a
// binary is not built.
func Launch(ctx context.Context, opts Options) (*Env, error) {
	etcdBin, err := ToolPath(Etcd)
	if err != nil {
		return nil, err
	}
	apiBin, err := ToolPath(KubeAPIServer)
	if err != nil {
		return nil, err
	}
	if opts.ReadyTimeout == 0 {
		opts.ReadyTimeout = 2 * time.Minute
	}
	if opts.Logf == nil {
		opts.Logf = func(string, ...any) {}
	}
	begin := time.Now()
	e := &Env{Dir: opts.Dir}
	if e.Dir == "" {
		if e.Dir, err = os.MkdirTemp("", "kubeenv-"); err != nil {
			return nil, fmt.Errorf("data dir: %w", err)
		}
		e.removeDir = true
	}
	// Ports are picked free and then released, so another process can take
	// one in between: retry the whole start a few times on that race.
	for attempt := 1; ; attempt++ {
		err = e.start(ctx, etcdBin, apiBin, opts)
		if err == nil {
			break
		}
		e.stopProcesses()
		if !errors.Is(err, errPortRace) || attempt == 3 {
			e.cleanupDir()
			return nil, err
		}
		opts.Logf("kubeenv: retrying start after a port collision: %v", err)
	}
	e.StartTime = time.Since(begin)
	return e, nil
}

var errPortRace = errors.New("port taken between picking and binding")

func (e *Env) start(ctx context.Context, etcdBin, apiBin string, opts Options) error {
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	etcdClient, etcdPeer, securePort := ports[0], ports[1], ports[2]
	run := filepath.Join(e.Dir, fmt.Sprintf("run-%d", securePort))
	if err := os.MkdirAll(run, 0o700); err != nil {
		return fmt.Errorf("run dir: %w", err)
	}

	ca, err := newAuthority()
	if err != nil {
		return err
	}
	_, svcNet, _ := net.ParseCIDR(ServiceCIDR)
	firstSvcIP := make(net.IP, 4)
	copy(firstSvcIP, svcNet.IP.To4())
	firstSvcIP[3]++
	servingCert, servingKey, err := ca.serving(append([]net.IP{firstSvcIP}, opts.ServingIPs...)...)
	if err != nil {
		return err
	}
	adminCert, adminKey, err := ca.client("kubeenv-admin", "system:masters")
	if err != nil {
		return err
	}
	files := map[string][]byte{"ca.crt": ca.certPEM, "apiserver.crt": servingCert, "apiserver.key": servingKey}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(run, name), data, 0o600); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
	}
	saKey, saPub := filepath.Join(run, "sa.key"), filepath.Join(run, "sa.pub")
	if err := serviceAccountKeys(saKey, saPub); err != nil {
		return err
	}

	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdClient)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeer)
	e.etcd, err = childproc.Start(Etcd, etcdBin, []string{
		"--name=kubeenv",
		"--data-dir=" + filepath.Join(run, "etcd"),
		"--listen-client-urls=" + etcdURL,
		"--advertise-client-urls=" + etcdURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kubeenv=" + peerURL,
		// Test data is throwaway: skipping fsync makes etcd fast on a
		// shared disk.
		"--unsafe-no-fsync",
		"--log-level=warn",
	}, nil, filepath.Join(e.Dir, "etcd.log"))
	if err != nil {
		return err
	}
	opts.Logf("kubeenv: etcd pid %d on %s", e.etcd.Pid(), etcdURL)
	if err := waitHTTP(ctx, e.etcd, etcdURL+"/health", 30*time.Second); err != nil {
		return err
	}

	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(securePort),
		// No controller manages the kubernetes Service's endpoints, and
		// the default reconciler refuses a loopback advertise address.
		"--endpoint-reconciler-type=none",
		"--tls-cert-file=" + filepath.Join(run, "apiserver.crt"),
		"--tls-private-key-file=" + filepath.Join(run, "apiserver.key"),
		"--client-ca-file=" + filepath.Join(run, "ca.crt"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saPub,
		"--service-account-signing-key-file=" + saKey,
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--authorization-mode=Node,RBAC",
		// The deploy bundle's DaemonSet is privileged; dry-run apply of it
		// must pass admission as it would on a real cluster.
		"--allow-privileged=true",
		"--profiling=false",
		"--v=1",
	}
	if opts.KubeletClient {
		crt, key, err := ca.client("kube-apiserver-kubelet-client", "system:masters")
		if err != nil {
			return err
		}
		for name, data := range map[string][]byte{"kubelet-client.crt": crt, "kubelet-client.key": key} {
			if err := os.WriteFile(filepath.Join(run, name), data, 0o600); err != nil {
				return fmt.Errorf("write %s: %w", name, err)
			}
		}
		args = append(args,
			"--kubelet-client-certificate="+filepath.Join(run, "kubelet-client.crt"),
			"--kubelet-client-key="+filepath.Join(run, "kubelet-client.key"),
			"--kubelet-preferred-address-types=InternalIP")
	}
	if opts.ListenAll {
		args = append(args, "--bind-address=0.0.0.0")
	}
	args = append(args, opts.APIServerArgs...)
	e.apiBin, e.apiArgs = apiBin, args
	e.apiserver, err = childproc.Start(KubeAPIServer, apiBin, args, nil, filepath.Join(e.Dir, "kube-apiserver.log"))
	if err != nil {
		return err
	}
	opts.Logf("kubeenv: kube-apiserver pid %d on https://127.0.0.1:%d", e.apiserver.Pid(), securePort)

	e.ca = ca
	e.CAFile, e.ServiceAccountKeyFile = filepath.Join(run, "ca.crt"), saKey
	e.Config = &rest.Config{
		Host: "https://127.0.0.1:" + strconv.Itoa(securePort),
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   ca.certPEM,
			CertData: adminCert,
			KeyData:  adminKey,
		},
		// Tests create many objects quickly; client-side throttling would
		// only slow them down. This is for the tests' own clients: an agent
		// under test gets its client from install-cni's KubeClientConfig,
		// with the shipped limit, never this one.
		QPS:   500,
		Burst: 1000,
	}
	if e.Client, err = kubernetes.NewForConfig(e.Config); err != nil {
		return fmt.Errorf("admin client: %w", err)
	}
	if e.Dynamic, err = dynamic.NewForConfig(e.Config); err != nil {
		return fmt.Errorf("admin dynamic client: %w", err)
	}
	e.mapper = restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(e.Client.Discovery()))
	if err := e.waitReady(ctx, opts.ReadyTimeout); err != nil {
		return err
	}
	return e.bootstrap(ctx)
}

// waitReady polls /readyz until it answers ok, the apiserver exits, or the
// timeout passes.
func (e *Env) waitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		body, err := e.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil && strings.TrimSpace(string(body)) == "ok" {
			return nil
		}
		last = err
		if e.apiserver.Exited() {
			return exitError(e.apiserver)
		}
		if e.etcd.Exited() {
			return exitError(e.etcd)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kube-apiserver not ready after %v (last error: %v); log tail:\n%s", timeout, last, e.apiserver.LogTail(30))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// exitError describes a child that exited during start, flagging a lost
// port race so Launch retries.
func exitError(p *childproc.Proc) error {
	tail := p.LogTail(30)
	err := fmt.Errorf("%s exited during start (%v); log tail:\n%s", p.Name, p.Err(), tail)
	if strings.Contains(tail, "address already in use") {
		return fmt.Errorf("%w: %w", errPortRace, err)
	}
	return err
}

// waitHTTP polls url until it answers 200, the process exits, or timeout.
func waitHTTP(ctx context.Context, p *childproc.Proc, url string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{Timeout: 2 * time.Second}
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if p.Exited() {
			return exitError(p)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not healthy at %s after %v; log tail:\n%s", p.Name, url, timeout, p.LogTail(30))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// freePorts returns n distinct loopback TCP ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("pick a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// APIServerPid is the process id of the current kube-apiserver, for a
// benchmark that reads its CPU time.
func (e *Env) APIServerPid() int {
	e.apiMu.Lock()
	defer e.apiMu.Unlock()
	return e.apiserver.Pid()
}

// StopAPIServer stops kube-apiserver (SIGTERM, then SIGKILL after a few
// seconds) and leaves etcd running: a control-plane outage. Every client
// sees connections refused until StartAPIServer.
func (e *Env) StopAPIServer() {
	e.apiMu.Lock()
	defer e.apiMu.Unlock()
	e.apiserver.Stop(5 * time.Second)
}

// StartAPIServer starts a stopped kube-apiserver again, on the same
// address with the same certificates and data, and waits until it is
// ready. It is a no-op while it runs.
func (e *Env) StartAPIServer(ctx context.Context, timeout time.Duration) error {
	e.apiMu.Lock()
	defer e.apiMu.Unlock()
	if !e.apiserver.Exited() {
		return nil
	}
	p, err := childproc.Start(KubeAPIServer, e.apiBin, e.apiArgs, nil, e.apiserver.LogPath)
	if err != nil {
		return err
	}
	e.apiserver = p
	return e.waitReady(ctx, timeout)
}

// Stop kills kube-apiserver and etcd and removes the data directory if
// Launch created it. It is safe to call more than once.
func (e *Env) Stop() {
	e.stopOnce.Do(func() {
		e.stopProcesses()
		e.cleanupDir()
	})
}

func (e *Env) stopProcesses() {
	e.apiMu.Lock()
	defer e.apiMu.Unlock()
	if e.apiserver != nil {
		e.apiserver.Stop(10 * time.Second)
	}
	if e.etcd != nil {
		e.etcd.Stop(10 * time.Second)
	}
}

func (e *Env) cleanupDir() {
	if e.removeDir {
		_ = os.RemoveAll(e.Dir)
	}
}
