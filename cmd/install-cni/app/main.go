package app

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
)

// hungExitGrace bounds the shutdown after the watchdog tripped: a part of
// the agent that hangs may hang the shutdown too; past this Main returns
// anyway (the next agent finds the node as a crash leaves it).
const hungExitGrace = 20 * time.Second

// Main is install-cni: it parses args and the environment, connects to
// the API server, and runs until SIGTERM or SIGINT.
func Main(args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := Parse(args, getenv, stderr)
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return err
	}
	log := slog.New(NewLogHandler(cfg.LogFormat, stderr, &slog.HandlerOptions{Level: level}))
	// The first line says which build runs and how it is set up.
	log.Info("install-cni starting", "version", buildinfo.Version(), "commit", buildinfo.Commit(), "node", cfg.NodeName, cfg.SettingsAttr(args, getenv))
	klog.SetSlogLogger(log.With("component", "client-go"))
	setMemoryLimit(getenv, log)

	var rc *rest.Config
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	client, err := kubeclient.NewForConfig(cfg.KubeClientConfig(rc))
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	ca := rc.CAData
	if len(ca) == 0 && rc.CAFile != "" {
		if ca, err = os.ReadFile(rc.CAFile); err != nil {
			return fmt.Errorf("API server CA: %w", err)
		}
	}
	a, err := New(Options{Config: cfg, Client: client, Logger: log, APIServer: rc.Host, APICA: ca})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-a.Hung():
	}
	// Run is shutting down after the watchdog; what hung may hang that
	// too, and the process must end for kubelet to restart it.
	t := time.NewTimer(hungExitGrace)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return fmt.Errorf("the watchdog gave up on the plugin event server and the shutdown did not end within %s: exiting as a crash would", hungExitGrace)
	}
}
