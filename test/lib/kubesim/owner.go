package kubesim

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Owner is the T a program (the benchmark, the sandbox) gives a kubelet
// simulator instead of a test: temp directories under Dir, cleanups that
// Close runs in reverse, and a Fatalf that Catch turns into an error.
type Owner struct {
	// Dir holds the temp directories.
	Dir string

	n        int
	cleanups []func()
}

// fatal carries a Fatalf out of the call that raised it, to Catch.
type fatal struct{ msg string }

// Helper is a no-op: there is no test log to attribute lines in.
func (o *Owner) Helper() {}

// Cleanup registers f for Close.
func (o *Owner) Cleanup(f func()) { o.cleanups = append(o.cleanups, f) }

// TempDir makes a new directory under Dir.
func (o *Owner) TempDir() string {
	o.n++
	d := filepath.Join(o.Dir, fmt.Sprintf("tmp-%d", o.n))
	_ = os.MkdirAll(d, 0o700)
	return d
}

// Fatalf stops the calling function; Catch returns the message as an error.
func (o *Owner) Fatalf(format string, args ...any) { panic(fatal{fmt.Sprintf(format, args...)}) }

// Close runs the cleanups, last registered first.
func (o *Owner) Close() {
	for i := len(o.cleanups) - 1; i >= 0; i-- {
		o.cleanups[i]()
	}
	o.cleanups = nil
}

// Catch runs f and returns an Owner's Fatalf inside it as an error; other
// panics go on.
func Catch(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			ft, ok := r.(fatal)
			if !ok {
				panic(r)
			}
			err = errors.New(ft.msg)
		}
	}()
	return f()
}
