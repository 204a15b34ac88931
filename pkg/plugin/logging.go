package plugin

import (
	"context"
	"log/slog"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
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

// logRecorder keeps a copy of the records a call wrote (the first
// ambient.MaxPluginLogRecords), for the agent's log.
type logRecorder struct {
	recs []ambient.PluginLogRecord
	size int // bytes of text kept
}

// maxRecordedBytes is the text a call keeps for the agent, well under the
// agent's request limit once in JSON.
const maxRecordedBytes = 32 << 10

// maxRecordedText is where a recorded message or value is cut: the agent
// takes at most 1 KiB each.
const maxRecordedText = 1000

// add keeps one record, until the count or the size budget is spent;
// attrs are key, value pairs.
func (r *logRecorder) add(lv slog.Level, msg string, attrs []string) {
	if len(r.recs) >= ambient.MaxPluginLogRecords || r.size >= maxRecordedBytes {
		return
	}
	name := "DEBUG"
	switch {
	case lv >= slog.LevelError:
		name = "ERROR"
	case lv >= slog.LevelWarn:
		name = "WARN"
	case lv >= slog.LevelInfo:
		name = "INFO"
	}
	msg = cut(msg)
	r.size += len(msg)
	for i := range attrs {
		attrs[i] = cut(attrs[i])
		r.size += len(attrs[i])
	}
	r.recs = append(r.recs, ambient.PluginLogRecord{Level: name, Msg: msg, Attrs: attrs})
}

func cut(s string) string {
	if len(s) > maxRecordedText {
		return s[:maxRecordedText]
	}
	return s
}

// teeHandler writes each record through h and keeps a copy in rec. It
// sees only the records h is enabled for, so at the default level (warn)
// a quiet call records nothing; like lazyHandler it formats its With
// attributes only when a record is written.
type teeHandler struct {
	h     slog.Handler
	rec   *logRecorder
	attrs []prefixed // the With attributes, in order
	group string     // the open groups, "a.b."
}

// prefixed is a With attribute and the groups open when it was added.
type prefixed struct {
	group string
	attr  slog.Attr
}

// Enabled reports whether the wrapped handler writes records of level l.
func (t *teeHandler) Enabled(ctx context.Context, l slog.Level) bool { return t.h.Enabled(ctx, l) }

// Handle writes r and keeps its copy.
func (t *teeHandler) Handle(ctx context.Context, r slog.Record) error {
	attrs := make([]string, 0, 2*(len(t.attrs)+r.NumAttrs()))
	for _, a := range t.attrs {
		attrs = append(attrs, a.group+a.attr.Key, a.attr.Value.String())
	}
	r.Attrs(func(a slog.Attr) bool {
		attrs = append(attrs, t.group+a.Key, a.Value.String())
		return true
	})
	t.rec.add(r.Level, r.Message, attrs)
	return t.h.Handle(ctx, r)
}

// WithAttrs keeps attrs for the records to come, in both.
func (t *teeHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	kept := t.attrs[:len(t.attrs):len(t.attrs)]
	for _, a := range attrs {
		kept = append(kept, prefixed{t.group, a})
	}
	return &teeHandler{h: t.h.WithAttrs(attrs), rec: t.rec, attrs: kept, group: t.group}
}

// WithGroup opens a group in both.
func (t *teeHandler) WithGroup(name string) slog.Handler {
	return &teeHandler{h: t.h.WithGroup(name), rec: t.rec, attrs: t.attrs, group: t.group + name + "."}
}
