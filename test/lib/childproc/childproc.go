// Package childproc runs the long-lived child processes of tests and demos
// (etcd and kube-apiserver for kubeenv, a real node's daemons for realnode,
// the shipped install-cni for the simulated node) with their output in a
// log file, and stops them.
package childproc

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

// Proc is one child with its log file.
type Proc struct {
	// Name names the child in errors; LogPath is its log.
	Name, LogPath string

	cmd  *exec.Cmd
	done chan struct{} // closed once the child has exited and been reaped
	err  error         // Wait's result, valid after done is closed
}

// Start starts path with args (and env added to this process's
// environment, if any), its output appended to logPath. The child gets
// SIGKILL if this process dies (Pdeathsig), so a crashed or timed-out run
// leaves nothing behind. Pdeathsig fires when the *thread* that forked the
// child exits, so the fork happens on a goroutine locked to its own thread
// that lives exactly as long as the child: no other goroutine (say one that
// enters a netns and exits with its thread locked) can take that thread
// down early.
func Start(name, path string, args, env []string, logPath string) (*Proc, error) {
	var environ []string
	if env != nil {
		environ = append(os.Environ(), env...)
	}
	return start(name, path, "", args, environ, logPath)
}

// StartIn is Start with dir as the child's working directory: for a
// program that keeps files at paths relative to it (istiod's ./etc/...).
func StartIn(dir, name, path string, args, env []string, logPath string) (*Proc, error) {
	var environ []string
	if env != nil {
		environ = append(os.Environ(), env...)
	}
	return start(name, path, dir, args, environ, logPath)
}

// StartEnviron is Start with environ as the child's whole environment,
// nothing of this process's: for a child whose behaviour is measured or
// pinned (a GOGC or GODEBUG of the caller's shell would change it).
func StartEnviron(name, path string, args, environ []string, logPath string) (*Proc, error) {
	if environ == nil {
		environ = []string{} // exec reads a nil Env as "inherit"
	}
	return start(name, path, "", args, environ, logPath)
}

func start(name, path, dir string, args, environ []string, logPath string) (*Proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = environ
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	p := &Proc{Name: name, LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() { // owner: the Proc; Stop waits on done
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

// Pid is the child's process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the child has exited (and been reaped).
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Err is how the child ended; valid once Exited.
func (p *Proc) Err() error {
	if !p.Exited() {
		return nil
	}
	return p.err
}

// Stop asks the child to exit with SIGTERM, then kills it after grace. It
// returns how a child it stopped ended (nil for a clean exit), or that it
// had to be killed; for one that had exited already, how it ended. A nil
// Proc is left alone.
func (p *Proc) Stop(grace time.Duration) error {
	if p == nil {
		return nil
	}
	if p.Exited() {
		return p.err
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.err
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not stop within %v of SIGTERM; killed", p.Name, grace)
	}
}

// Signal sends sig without waiting (a SIGTERM whose shutdown a test
// interrupts, say); a nil or exited Proc is left alone.
func (p *Proc) Signal(sig os.Signal) error {
	if p == nil || p.Exited() {
		return nil
	}
	return p.cmd.Process.Signal(sig)
}

// Kill sends SIGKILL, as an OOM kill would (nothing of the child's
// shutdown runs), and waits until the child is reaped.
func (p *Proc) Kill() {
	if p == nil || p.Exited() {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// LogTail returns the last lines of the child's log, for error messages.
func (p *Proc) LogTail(lines int) string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return fmt.Sprintf("(no %s log: %v)", p.Name, err)
	}
	all := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
