package procstat

import "testing"

func TestParseStatAndRSS(t *testing.T) {
	c, err := ParseStat([]byte("42 (install cni) S 1 2 3 4 5 6 7 8 9 10 150 50 30 20 20 0 12 0"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Own.Milliseconds() != 2000 || c.Children.Milliseconds() != 500 {
		t.Errorf("cpu %+v", c)
	}
	for _, bad := range []string{"", "42 install S 1", "42 (x) S 1 2 3 4 5 6 7 8 9 10 a b c d", "42 (x) S 1 2 3 4 5 6 7 8 9 10 -1 0 0 0 0"} {
		if _, err := ParseStat([]byte(bad)); err == nil {
			t.Errorf("ParseStat(%q): want an error", bad)
		}
	}
	if m, err := ParseStatus([]byte("Name:\tx\nVmRSS:\t  1024 kB\nRssFile:\t2 kB\n"), "VmRSS", "RssFile"); err != nil || m["VmRSS"] != 1<<20 || m["RssFile"] != 2048 {
		t.Errorf("ParseStatus = %v, %v", m, err)
	}
	for _, bad := range []string{"", "VmRSS: lots kB\n", "VmRSS: -5 kB\n"} {
		if _, err := ParseStatus([]byte(bad), "VmRSS"); err == nil {
			t.Errorf("ParseStatus(%q): want an error", bad)
		}
	}
}
