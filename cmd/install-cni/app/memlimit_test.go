package app

import "testing"

func TestSoftMemoryLimit(t *testing.T) {
	for in, want := range map[string]int64{
		"268435456\n":         214748364, // the chart's 256 MiB
		"max\n":               0,
		"9223372036854771712": 0, // cgroup v1's "no limit"
		"":                    0,
		"garbage":             0,
	} {
		got, ok := softMemoryLimit(in)
		if ok != (want != 0) || got != want {
			t.Errorf("softMemoryLimit(%q) = %d, %v; want %d", in, got, ok, want)
		}
	}
}
