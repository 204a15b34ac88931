// Package buildinfo holds the version and commit stamped into every
// binary at build time (the Makefile sets them with -ldflags -X; see
// docs/deploy.md). An unstamped build says "dev".
//
// The plugin links this package too, so it holds two strings and imports
// nothing that runs at start-up.
package buildinfo

import "runtime"

// Set by the linker: -X github.com/ambient-cni/ambient-cni/pkg/buildinfo.version=...
// and ...buildinfo.commit=...; never written at run time.
var (
	version = "dev"
	commit  = ""
)

// Version is the release version, e.g. v0.3.0, v0.3.0-4-gabc1234-dirty
// (git describe), or "dev" for an unstamped build.
func Version() string { return version }

// Commit is the full git commit the binary was built from, or "unknown".
func Commit() string {
	if commit == "" {
		return "unknown"
	}
	return commit
}

// String is the one-line answer of --version: the program, its version,
// commit and the Go toolchain it was built with.
func String(program string) string {
	return program + " " + Version() + " (commit " + Commit() + ", " + runtime.Version() + ")"
}

// IsVersionFlag reports whether args (without the program name) ask for
// the version: exactly one argument, --version or -version.
func IsVersionFlag(args []string) bool {
	return len(args) == 1 && (args[0] == "--version" || args[0] == "-version")
}
