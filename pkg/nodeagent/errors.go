package nodeagent

import (
	"errors"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// ErrSandboxTornDown is the controller finding a pod's namespace whose
// sandbox a CNI DEL just tore down: the pod is going, or its next sandbox
// comes through its own ADD, so the controller need not warn about it.
var ErrSandboxTornDown = errors.New("belongs to a sandbox the runtime tore down")

// RetryableError marks a failure that may go away on its own (no ztunnel
// yet, an API hiccup, a busy xtables lock): the plugin maps it to CNI
// error 11 so the runtime simply retries.
type RetryableError struct {
	Err error
}

// Error describes the wrapped error.
func (e *RetryableError) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *RetryableError) Unwrap() error { return e.Err }

// Retryable wraps err as retryable; nil stays nil.
func Retryable(err error) error {
	if err == nil {
		return nil
	}
	return &RetryableError{Err: err}
}

// IsRetryable reports whether err (or anything it wraps) is retryable.
func IsRetryable(err error) bool {
	var r *RetryableError
	return errors.As(err, &r)
}

// InvalidError marks a request that can never succeed as given (a bad
// netns path, a malformed field); the event server answers it with 400.
type InvalidError struct {
	Err error
}

// Error describes the wrapped error.
func (e *InvalidError) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *InvalidError) Unwrap() error { return e.Err }

func invalid(err error) error { return &InvalidError{Err: err} }

// IsInvalid reports whether err (or anything it wraps) is an InvalidError
// or a path or namespace pkg/netns refused as never usable
// (netns.ErrInvalid).
func IsInvalid(err error) bool {
	var i *InvalidError
	return errors.As(err, &i) || errors.Is(err, netns.ErrInvalid)
}

// MismatchError marks a CNI CHECK that found the pod's capture not as it
// should be (not enrolled, another netns, drifted rules): neither a bad
// request nor an agent failure. The event server answers it with 409.
type MismatchError struct {
	Err error
}

// Error describes the wrapped error.
func (e *MismatchError) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *MismatchError) Unwrap() error { return e.Err }

func mismatch(err error) error { return &MismatchError{Err: err} }

// IsMismatch reports whether err (or anything it wraps) is a MismatchError.
func IsMismatch(err error) bool {
	var m *MismatchError
	return errors.As(err, &m)
}

// ruleError tells OnRuleError (the metrics) about a failed rule
// operation: "apply", "verify", "remove", "probe".
func (a *Agent) ruleError(op string) {
	if a.cfg.OnRuleError != nil {
		a.cfg.OnRuleError(op)
	}
}
