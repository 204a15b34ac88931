// Package procstat reads a process's CPU times and memory from /proc, for
// the suites that measure or watch the shipped agent.
package procstat

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times: 100 on every
// Linux architecture Go supports (the kernel exports it as AT_CLKTCK).
const clockTicks = 100

// CPUTimes are a process's CPU times from /proc/<pid>/stat.
type CPUTimes struct {
	// Own is utime+stime; Children is cutime+cstime (children it waited
	// for, e.g. iptables-restore runs).
	Own, Children time.Duration
}

// Total is own plus children.
func (c CPUTimes) Total() time.Duration { return c.Own + c.Children }

// Sub returns c - o.
func (c CPUTimes) Sub(o CPUTimes) CPUTimes {
	return CPUTimes{Own: c.Own - o.Own, Children: c.Children - o.Children}
}

// ReadCPU reads utime, stime, cutime and cstime of pid.
func ReadCPU(pid int) (CPUTimes, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return CPUTimes{}, err
	}
	return ParseStat(b)
}

// ParseStat reads utime, stime, cutime and cstime from a /proc/<pid>/stat
// line.
func ParseStat(b []byte) (CPUTimes, error) {
	// The command name (field 2) is in parentheses and may hold spaces:
	// count fields after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return CPUTimes{}, fmt.Errorf("malformed stat %q", b)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime..cstime are fields 14..17.
	if len(f) < 15 {
		return CPUTimes{}, fmt.Errorf("short stat %q", b)
	}
	var v [4]int64
	for j := range v {
		n, err := strconv.ParseInt(f[11+j], 10, 64)
		if err != nil || n < 0 {
			return CPUTimes{}, fmt.Errorf("stat field %d: %q", 14+j, f[11+j])
		}
		v[j] = n
	}
	tick := time.Second / clockTicks
	return CPUTimes{Own: time.Duration(v[0]+v[1]) * tick, Children: time.Duration(v[2]+v[3]) * tick}, nil
}

// ReadStatus returns kB fields of /proc/<pid>/status (VmRSS, RssAnon,
// RssFile, ...) in bytes.
func ReadStatus(pid int, fields ...string) (map[string]int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	return ParseStatus(b, fields...)
}

// ParseStatus returns kB fields of a /proc status-like file
// (/proc/<pid>/status, /proc/meminfo) in bytes; a missing field is an
// error.
func ParseStatus(b []byte, fields ...string) (map[string]int64, error) {
	out := map[string]int64{}
	for l := range strings.SplitSeq(string(b), "\n") {
		name, v, ok := strings.Cut(l, ":")
		if !ok || !slices.Contains(fields, name) {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		if err != nil || kb < 0 {
			return nil, fmt.Errorf("%s %q", name, v)
		}
		out[name] = kb * 1024
	}
	for _, f := range fields {
		if _, ok := out[f]; !ok {
			return nil, fmt.Errorf("no %s in status", f)
		}
	}
	return out, nil
}

// LoadAvg returns the 1, 5 and 15 minute load averages.
func LoadAvg() [3]float64 {
	var out [3]float64
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return out
	}
	f := strings.Fields(string(b))
	for i := 0; i < 3 && i < len(f); i++ {
		out[i], _ = strconv.ParseFloat(f[i], 64)
	}
	return out
}
