// Package scrape reads samples from the agent's Prometheus /metrics, for
// the suites that watch the shipped agent from outside.
package scrape

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// timeout bounds one scrape: a hung agent fails the caller, never hangs it.
const timeout = 5 * time.Second

// Text is the whole /metrics page at base (a URL as simnode.HealthURL
// returns).
func Text(base string) (string, error) {
	resp, err := (&http.Client{Timeout: timeout}).Get(base + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s/metrics: %s", base, resp.Status)
	}
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// Values reads unlabelled samples of the /metrics at base; a name with no
// such sample is missing from the map.
func Values(base string, names ...string) (map[string]float64, error) {
	text, err := Text(base)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 || !slices.Contains(names, f[0]) {
			continue
		}
		if v, err := strconv.ParseFloat(f[1], 64); err == nil {
			out[f[0]] = v
		}
	}
	return out, sc.Err()
}

// Sum adds up every sample of a metric (all its label values) on the
// /metrics at base; a metric with no sample is an error.
func Sum(base, name string) (float64, error) {
	text, err := Text(base)
	if err != nil {
		return 0, err
	}
	sum, seen := 0.0, false
	for l := range strings.SplitSeq(text, "\n") {
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		f := strings.Fields(l)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("%q: %w", l, err)
		}
		sum, seen = sum+v, true
	}
	if !seen {
		return 0, fmt.Errorf("no %s in /metrics", name)
	}
	return sum, nil
}
