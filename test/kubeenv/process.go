package kubeenv

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// process is one child (etcd or kube-apiserver) with its log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed once the child has exited and been reaped
	err     error         // Wait's result, valid after done is closed
}

// startProcess starts a child whose output goes to logPath. The child gets
// SIGKILL if the test binary dies (Pdeathsig), so a crashed or timed-out test
// run leaves no apiserver behind. Pdeathsig fires when the *thread* that
// forked the child exits, so the fork happens on a goroutine locked to its own
// thread that lives exactly as long as the child: no other goroutine (say one
// that enters a netns and exits with its thread locked) can take that thread
// down early.
func startProcess(name, path string, args []string, logPath string) (*process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(p.done)
		defer logf.Close()
		if err := cmd.Start(); err != nil {
			started <- err
			p.err = err
			return
		}
		started <- nil
		p.err = cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return p, nil
}

// exited reports whether the child has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop asks the child to exit with SIGTERM, then kills it after grace.
func (p *process) stop(grace time.Duration) {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// logTail returns the last lines of the child's log, for error messages.
func (p *process) logTail(lines int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(no %s log: %v)", p.name, err)
	}
	all := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
