package app

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The parsers of the settings' values: each sets one field of Config.

func str(dst func(*Config) *string) func(*Config, string) error {
	return func(c *Config, v string) error { *dst(c) = v; return nil }
}

func list(dst func(*Config) *[]string) func(*Config, string) error {
	return func(c *Config, v string) error {
		var out []string
		for s := range strings.SplitSeq(v, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
		*dst(c) = out
		return nil
	}
}

// dirList parses a comma-separated list of absolute directories, strictly:
// an empty entry (a stray comma) or a directory listed twice is an error,
// not skipped, since a list of host paths that is not what its writer
// meant should stop the agent, not install somewhere unexpected. An empty
// value is no directory.
func dirList(dst func(*Config) *[]string) func(*Config, string) error {
	return func(c *Config, v string) error {
		var out []string
		if strings.TrimSpace(v) != "" {
			for s := range strings.SplitSeq(v, ",") {
				s = strings.TrimSpace(s)
				switch {
				case s == "":
					return errors.New("empty entry (a stray comma?)")
				case !strings.HasPrefix(s, "/"):
					return fmt.Errorf("%q is not an absolute path", s)
				case slices.Contains(out, path.Clean(s)):
					return fmt.Errorf("%s is listed twice", path.Clean(s))
				}
				out = append(out, path.Clean(s))
			}
		}
		*dst(c) = out
		return nil
	}
}

func boolean(dst func(*Config) *bool) func(*Config, string) error {
	return func(c *Config, v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("want true or false: %w", err)
		}
		*dst(c) = b
		return nil
	}
}

func duration(dst func(*Config) *time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return err
		}
		if d <= 0 {
			return fmt.Errorf("must be positive")
		}
		*dst(c) = d
		return nil
	}
}

// period parses a duration that may be 0 (off), never negative; a
// positive one below min is refused.
func period(min time.Duration, dst func(*Config) *time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return err
		}
		if d < 0 || (d > 0 && d < min) {
			return fmt.Errorf("must be 0 (off) or at least %s", min)
		}
		*dst(c) = d
		return nil
	}
}

func positiveFloat(dst func(*Config) *float32) func(*Config, string) error {
	return func(c *Config, v string) error {
		f, err := strconv.ParseFloat(v, 32)
		if err != nil || !(f > 0) || math.IsInf(f, 0) {
			return fmt.Errorf("want a positive number")
		}
		*dst(c) = float32(f)
		return nil
	}
}

func positiveInt(dst func(*Config) *int) func(*Config, string) error {
	return func(c *Config, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			return fmt.Errorf("want a positive integer")
		}
		*dst(c) = n
		return nil
	}
}

func addr(dst func(*Config) *netip.Addr, want6 bool) func(*Config, string) error {
	return func(c *Config, v string) error {
		a, err := netip.ParseAddr(v)
		if err != nil {
			return err
		}
		if a.Is6() != want6 || a.Zone() != "" {
			return fmt.Errorf("%s is not a plain IPv%d address", v, map[bool]int{false: 4, true: 6}[want6])
		}
		*dst(c) = a
		return nil
	}
}
