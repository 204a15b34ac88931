package nftables

import (
	"fmt"
	"slices"

	gnft "github.com/google/nftables"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// HasTables reports whether the namespace at netnsPath holds an inet table
// named in names.
func HasTables(netnsPath string, names []string) (bool, error) {
	c, err := dial(netnsPath, false)
	if err != nil {
		return false, err
	}
	defer func() { _ = c.close() }()
	tables, err := c.r.ListTablesOfFamily(gnft.TableFamilyINet)
	if err != nil {
		return false, fmt.Errorf("list nf_tables tables in netns %s: %w", netnsPath, err)
	}
	for _, t := range tables {
		if slices.Contains(names, t.Name) {
			return true, nil
		}
	}
	return false, nil
}

// Probe checks, in the caller's network namespace, that the kernel takes
// what this package installs: an inet table with nat, route and filter
// base chains, sets, and every expression the rules use. It adds the
// tables and deletes them again in the same transaction, so nothing stays;
// callers run it in a throwaway namespace anyway.
func Probe() error {
	p, err := renderPod(ruleset.PodConfig{DNSCapture: true, VirtualInterfaces: []string{"probe+"}})
	if err != nil {
		return err
	}
	h, err := renderHost(ruleset.HostProbeConfig{}, ruleset.Families)
	if err != nil {
		return err
	}
	p.tables = append(p.tables, h.tables...)
	c, err := dial("", true)
	if err != nil {
		return err
	}
	defer func() { _ = c.close() }()
	add(c.q.Conn, p)
	for _, t := range p.tables {
		c.q.DelTable(&gnft.Table{Name: t.name, Family: gnft.TableFamilyINet})
	}
	if err := c.flush(); err != nil {
		return fmt.Errorf("nf_tables probe: %w", err)
	}
	return nil
}
