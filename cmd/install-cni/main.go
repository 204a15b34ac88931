// Command install-cni is the ambient-cni DaemonSet process: it installs
// the CNI plugin on the node, runs the node agent, and serves health and
// metrics. See docs/install-cni.md for its settings.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/ambient-cni/ambient-cni/pkg/agentconfig"
	"github.com/ambient-cni/ambient-cni/pkg/daemon"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "install-cni:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg, err := agentconfig.Parse(os.Args[1:], os.Getenv, os.Stderr)
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return err
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	klog.SetSlogLogger(log.With("component", "client-go"))

	var rc *rest.Config
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg.KubeClientConfig(rc))
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	d, err := daemon.New(daemon.Options{Config: cfg, Client: client, Logger: log})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log.Info("install-cni starting", "node", cfg.NodeName)
	return d.Run(ctx)
}
