package kubeenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// startBuilder runs a stand-in builder (a sleeping process) listed under
// .builders in a fresh tools cache as building names.
func startBuilder(t *testing.T, names string) (cache string, cmd *exec.Cmd) {
	t.Helper()
	cache = t.TempDir()
	t.Setenv("AMBIENT_TOOLS_CACHE", cache)
	cmd = exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if err := os.MkdirAll(filepath.Join(cache, ".builders"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cache, ".builders", strconv.Itoa(cmd.Process.Pid)), []byte(names), 0o644); err != nil {
		t.Fatal(err)
	}
	return cache, cmd
}

func TestAwaitToolWaitsForItsBuilder(t *testing.T) {
	cache, _ := startBuilder(t, "kubelet\nistiod\n")
	tool := filepath.Join(cache, "istiod-v1", "istiod")
	go func() {
		time.Sleep(time.Second)
		_ = os.MkdirAll(filepath.Dir(tool), 0o755)
		_ = os.WriteFile(tool, []byte("#!/bin/sh\n"), 0o755)
	}()
	if !AwaitTool("istiod", tool, t.Logf) {
		t.Fatal("did not wait for a tool its builder lists")
	}
	if _, err := os.Stat(tool); err != nil {
		t.Fatalf("returned before the tool was there: %v", err)
	}
}

func TestAwaitToolStopsWhenTheBuilderIsGone(t *testing.T) {
	cache, cmd := startBuilder(t, "istiod\n")
	tool := filepath.Join(cache, "istiod-v1", "istiod")
	go func() {
		time.Sleep(time.Second)
		_ = cmd.Process.Kill()
	}()
	done := make(chan bool, 1)
	go func() { done <- AwaitTool("istiod", tool, t.Logf) }()
	select {
	case waited := <-done:
		if !waited {
			t.Error("did not wait while the builder ran")
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("still waiting two minutes after its builder was killed")
	}
}

func TestAwaitToolDoesNotWaitForOthers(t *testing.T) {
	cache, _ := startBuilder(t, "kubelet\n")
	if AwaitTool("istiod", filepath.Join(cache, "istiod-v1", "istiod"), t.Logf) {
		t.Error("waited for a tool no builder lists")
	}
}
