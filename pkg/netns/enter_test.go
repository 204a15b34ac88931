package netns

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// init runs on the main goroutine, on the process's main thread; locking
// keeps TestMain there, so it can switch the thread group leader: the case
// the runtime does not discard a thread for.
func init() { runtime.LockOSThread() }

// mainThreadEnter is what switching the main thread into a new namespace
// and back did to the process's own namespace ("" = nothing, or not run:
// not root).
var mainThreadEnter string

// enterOnMainThread, from TestMain, runs the thread switch on the main
// thread, where /proc/self/ns/net (which the agent takes for the host's)
// resolves.
func enterOnMainThread() {
	if os.Geteuid() == 0 {
		before, _ := os.Readlink("/proc/self/ns/net")
		err := inThread(unshareNet, func() error { return nil })
		runtime.LockOSThread() // it unlocked once; stay on the main thread
		if after, _ := os.Readlink("/proc/self/ns/net"); after != before {
			mainThreadEnter = fmt.Sprintf("/proc/self/ns/net is %s after the switch, was %s (error: %v)", after, before, err)
		}
	}
	runtime.UnlockOSThread()
}

// Run on the main thread, a switch leaves the process's namespace (what
// /proc/self/ns/net names, "the host" to the agent) as it was.
func TestEnterOnTheMainThreadLeavesTheProcessNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	if mainThreadEnter != "" {
		t.Fatal(mainThreadEnter)
	}
}

// Run on any thread, a switch puts that thread back where it was.
func TestEnterLeavesTheThreadWhereItWas(t *testing.T) {
	testnet.RequireRoot(t)
	runtime.LockOSThread()
	before, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	var inside string
	if err := inThread(unshareNet, func() error {
		inside, err = os.Readlink("/proc/thread-self/ns/net")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread() // it unlocked once; read on the same thread
	defer runtime.UnlockOSThread()
	after, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if inside == before {
		t.Errorf("fn ran in the thread's own namespace %s, not a new one", inside)
	}
	if after != before {
		t.Fatalf("the switch left its thread in %s (was %s)", after, before)
	}
}

// Do runs fn inside the namespace, DoInNew in a fresh one; from any
// goroutine, both leave every thread of the process in the namespace the
// process has. A path that is no namespace is an error, and "" is the
// caller's namespace.
func TestDoLeavesNoThreadBehind(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	want := netnsOf(t, pod.Path())
	self, _ := os.Readlink("/proc/self/ns/net")
	for range 20 {
		var got Identity
		if err := Do(pod.Path(), func() error {
			got = netnsOf(t, "/proc/thread-self/ns/net")
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("fn ran in %+v, want the pod's %+v", got, want)
		}
		var fresh string
		if err := DoInNew(func() error {
			var err error
			fresh, err = os.Readlink("/proc/thread-self/ns/net")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if fresh == self {
			t.Fatalf("DoInNew ran fn in the process's namespace %s", fresh)
		}
	}
	if err := Do("/dev/null", func() error { return nil }); err == nil {
		t.Error("Do entered /dev/null")
	}
	if err := Do(filepath.Join(t.TempDir(), "missing"), func() error { return nil }); err == nil {
		t.Error("Do entered a missing path")
	}
	ran := false
	if err := Do("", func() error { ran = true; return nil }); err != nil || !ran {
		t.Errorf(`Do(""): ran %v, %v`, ran, err)
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		ns, err := os.Readlink("/proc/self/task/" + task.Name() + "/ns/net")
		if err == nil && ns != self {
			t.Errorf("thread %s is in %s, the process in %s", task.Name(), ns, self)
		}
	}
}

// socketFile is a socket as an io.Closer for Socket.
type socketFile struct{ fd int }

func (s socketFile) Close() error { return unix.Close(s.fd) }

// Socket's socket lives in the namespace it was opened in (the kernel
// tells, SIOCGSKNS), the caller's thread never left its own, and dial's
// error comes back as it is.
func TestSocketOpensInsideTheNamespace(t *testing.T) {
	testnet.RequireRoot(t)
	pod := testnet.NewNS(t)
	dial := func() (socketFile, error) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		return socketFile{fd}, err
	}
	nsOfSocket := func(s socketFile) Identity {
		nsfd, err := unix.IoctlRetInt(s.fd, unix.SIOCGSKNS)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(nsfd)
		return netnsOf(t, fmt.Sprintf("/proc/self/fd/%d", nsfd))
	}
	for _, tc := range []struct{ path, want string }{{pod.Path(), pod.Path()}, {"", "/proc/thread-self/ns/net"}} {
		runtime.LockOSThread()
		want := netnsOf(t, tc.want)
		s, err := Socket(tc.path, dial)
		if err != nil {
			runtime.UnlockOSThread()
			t.Fatal(err)
		}
		got := nsOfSocket(s)
		runtime.UnlockOSThread()
		_ = s.Close()
		if got != want {
			t.Errorf("Socket(%q): the socket is in %+v, want %+v", tc.path, got, want)
		}
	}
	if _, err := Socket(pod.Path(), func() (socketFile, error) { return socketFile{-1}, unix.EPROTONOSUPPORT }); err != unix.EPROTONOSUPPORT {
		t.Errorf("dial's error came back as %v", err)
	}
	if _, err := Socket("/dev/null", dial); err == nil {
		t.Error("Socket dialled in /dev/null")
	}
}
