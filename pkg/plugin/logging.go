package plugin

import (
	"context"
	"log/slog"
)

// lazyHandler keeps the attributes a logger is given with With and hands
// them to the wrapped handler only when a record is written: at the
// default level nothing is, and a text handler would otherwise format
// every With attribute at every exec.
type lazyHandler struct {
	h     slog.Handler
	attrs []slog.Attr
}

// Enabled reports whether the wrapped handler writes records of level l.
func (l *lazyHandler) Enabled(ctx context.Context, lv slog.Level) bool {
	return l.h.Enabled(ctx, lv)
}

// Handle writes r with the attributes kept so far.
func (l *lazyHandler) Handle(ctx context.Context, r slog.Record) error {
	return l.h.WithAttrs(l.attrs).Handle(ctx, r)
}

// WithAttrs keeps attrs for the records to come.
func (l *lazyHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &lazyHandler{h: l.h, attrs: append(l.attrs[:len(l.attrs):len(l.attrs)], attrs...)}
}

// WithGroup applies the kept attributes, then opens the group.
func (l *lazyHandler) WithGroup(name string) slog.Handler {
	return &lazyHandler{h: l.h.WithAttrs(l.attrs).WithGroup(name)}
}
