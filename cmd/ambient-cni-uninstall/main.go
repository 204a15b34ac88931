// Command ambient-cni-uninstall is the chart's pre-delete hook (package
// predelete): it deletes the release's signal Service, then the agent's
// DaemonSet in the foreground, and waits until its pods are gone, so that
// each agent releases the pods it captured while it still has its RBAC.
//
// Settings come from the environment: AMBIENT_POD_NAMESPACE (the
// release namespace), AMBIENT_DAEMONSET_NAME, AMBIENT_RELEASE_SIGNAL
// (optional), AMBIENT_UNINSTALL_TIMEOUT
// (a Go duration, default 5m), AMBIENT_LOG_FORMAT (text, the default, or
// json, as the agent's). It uses the in-cluster configuration.
// --version prints the version and exits.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/client-go/rest"

	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/predelete"
)

func main() {
	if buildinfo.IsVersionFlag(os.Args[1:]) {
		fmt.Println(buildinfo.String("ambient-cni-uninstall"))
		return
	}
	var h slog.Handler = slog.NewTextHandler(os.Stderr, nil)
	if os.Getenv("AMBIENT_LOG_FORMAT") == "json" {
		h = slog.NewJSONHandler(os.Stderr, nil)
	}
	log := slog.New(h)
	log.Info("ambient-cni-uninstall starting", "version", buildinfo.Version(), "commit", buildinfo.Commit())
	if err := run(log); err != nil {
		log.Error("uninstall hook failed", "err", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	ns, name := os.Getenv("AMBIENT_POD_NAMESPACE"), os.Getenv("AMBIENT_DAEMONSET_NAME")
	if ns == "" || name == "" {
		return errors.New("AMBIENT_POD_NAMESPACE and AMBIENT_DAEMONSET_NAME must be set")
	}
	timeout := 5 * time.Minute
	if v := os.Getenv("AMBIENT_UNINSTALL_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return fmt.Errorf("AMBIENT_UNINSTALL_TIMEOUT=%q: want a positive duration", v)
		}
		timeout = d
	}
	cfg, err := rest.InClusterConfig()
	if err != nil {
		return fmt.Errorf("kubernetes client config: %w", err)
	}
	cfg.UserAgent = "ambient-cni-uninstall"
	client, err := kubeclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return predelete.DeleteDaemonSet(ctx, predelete.Options{Client: client, Namespace: ns, Name: name,
		ReleaseSignal: os.Getenv("AMBIENT_RELEASE_SIGNAL"), Logger: log})
}
