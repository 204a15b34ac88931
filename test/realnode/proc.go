package realnode

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// proc is one daemon of the node (containerd, kubelet, ...) with its log.
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed once the child has exited and been reaped
	err     error         // Wait's result, valid after done is closed
}

// startProc starts a daemon whose output goes to logPath. It gets SIGKILL
// when the thread that forked it exits (Pdeathsig): a crashed demo or test
// leaves no daemon running (Up of the next node then reaps the rest). The
// fork happens on a goroutine locked to its own thread for the child's
// lifetime, so no other goroutine can take that thread down early.
func startProc(name, path string, args []string, env []string, logPath string) (*proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	p := &proc{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() { // owner: the proc; stop waits on done
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

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, then SIGKILL after grace.
func (p *proc) stop(grace time.Duration) {
	if p == nil || p.exited() {
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

// exitErr describes a daemon that exited early, with its log's tail.
func (p *proc) exitErr() error {
	return fmt.Errorf("%s exited (%v); log tail:\n%s", p.name, p.err, logTail(p.logPath, 25))
}

func logTail(path string, lines int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	all := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// procStart returns a process's start time in clock ticks since boot
// (field 22 of /proc/<pid>/stat), which with the pid identifies it across
// pid reuse.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces: split after its ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("malformed stat")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, errors.New("short stat")
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// alive reports whether the process pid with start time start still runs.
func alive(pid int, start uint64) bool {
	if pid <= 0 {
		return false
	}
	s, err := procStart(pid)
	return err == nil && s == start
}

// pidsWithArg returns the processes whose command line has arg as one of
// its arguments: the containerd shims of this node (started with
// -address <our socket>) outlive containerd by design.
func pidsWithArg(arg string) []int {
	des, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, de := range des {
		pid, err := strconv.Atoi(de.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile("/proc/" + de.Name() + "/cmdline")
		if err != nil {
			continue
		}
		for _, a := range bytes.Split(b, []byte{0}) {
			if string(a) == arg {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// execCommand is exec.Command (a seam for nothing but brevity).
func execCommand(name string, args ...string) *exec.Cmd { return exec.Command(name, args...) }
