package iptables

import (
	"bufio"
	"errors"
	"fmt"
	"strings"
)

// Limits on iptables-save input: a pod namespace's dump is a few kilobytes,
// so anything near these is hostile or broken and is rejected.
const (
	maxSaveBytes   = 16 << 20
	maxSaveLine    = 256 << 10
	maxNameLen     = 64
	maxRulesPerTbl = 200000
)

// Save is a parsed iptables-save (or ip6tables-save) dump.
type Save struct {
	// Tables in the order the dump lists them.
	Tables []*SavedTable
}

// SavedTable is one "*table ... COMMIT" block.
type SavedTable struct {
	Name string
	// Chains in declaration order, each holding its rules in order.
	Chains []*SavedChain
}

// SavedChain is one chain with its policy ("-" for user-defined chains).
type SavedChain struct {
	Name   string
	Policy string
	Rules  []SavedRule
}

// SavedRule is one "-A chain ..." line, split into arguments with
// iptables-save's quoting removed.
type SavedRule struct {
	Args []string
}

// Table returns the named table or nil.
func (s *Save) Table(name string) *SavedTable {
	if s == nil {
		return nil
	}
	for _, t := range s.Tables {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// Chain returns the named chain or nil.
func (t *SavedTable) Chain(name string) *SavedChain {
	if t == nil {
		return nil
	}
	for _, c := range t.Chains {
		if c.Name == name {
			return c
		}
	}
	return nil
}

// Spec re-joins the rule's arguments in iptables-save's canonical form, so
// two rules are equal exactly when their Specs are.
func (r SavedRule) Spec() string { return joinArgs(r.Args) }

// Target returns the chain or target named by -j/--jump or -g/--goto, or
// "". The last such option wins: iptables-save prints the target after all
// matches, so a match argument (a comment, say) that looks like "-j" cannot
// hide the real target.
func (r SavedRule) Target() string {
	for i := len(r.Args) - 2; i >= 0; i-- {
		switch r.Args[i] {
		case "-j", "--jump", "-g", "--goto":
			return r.Args[i+1]
		}
	}
	return ""
}

// String renders the dump back in iptables-save format (without counters).
func (s *Save) String() string {
	var b strings.Builder
	for _, t := range s.Tables {
		b.WriteString("*" + t.Name + "\n")
		for _, c := range t.Chains {
			b.WriteString(":" + c.Name + " " + c.Policy + " [0:0]\n")
		}
		for _, c := range t.Chains {
			for _, r := range c.Rules {
				b.WriteString("-A " + c.Name + " " + r.Spec() + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// ParseSave parses iptables-save output. It accepts what iptables-save
// (legacy or nft) prints, with or without -c counters, and rejects anything
// structurally wrong: rules outside a table, rules for undeclared chains,
// unterminated tables or quotes, duplicate tables or chains, oversized input.
func ParseSave(in string) (*Save, error) {
	if len(in) > maxSaveBytes {
		return nil, fmt.Errorf("iptables-save output is %d bytes, limit %d", len(in), maxSaveBytes)
	}
	s := &Save{}
	var cur *SavedTable
	rules := 0
	sc := bufio.NewScanner(strings.NewReader(in))
	sc.Buffer(make([]byte, 0, 4096), maxSaveLine)
	lineNo := 0
	for sc.Scan() {
		lineNo++
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.IndexByte(line, 0) >= 0 {
			return nil, fmt.Errorf("line %d: NUL byte", lineNo)
		}
		switch {
		case line[0] == '*':
			if cur != nil {
				return nil, fmt.Errorf("line %d: table %q starts before table %q was committed", lineNo, line[1:], cur.Name)
			}
			name := line[1:]
			if err := checkName(name); err != nil {
				return nil, fmt.Errorf("line %d: table: %w", lineNo, err)
			}
			if s.Table(name) != nil {
				return nil, fmt.Errorf("line %d: table %q appears twice", lineNo, name)
			}
			cur = &SavedTable{Name: name}
			rules = 0
		case line == "COMMIT":
			if cur == nil {
				return nil, fmt.Errorf("line %d: COMMIT outside a table", lineNo)
			}
			s.Tables = append(s.Tables, cur)
			cur = nil
		case line[0] == ':':
			if cur == nil {
				return nil, fmt.Errorf("line %d: chain declared outside a table", lineNo)
			}
			f := strings.Fields(line[1:])
			if len(f) < 2 || len(f) > 3 {
				return nil, fmt.Errorf("line %d: malformed chain declaration %q", lineNo, truncate(line))
			}
			if err := checkName(f[0]); err != nil {
				return nil, fmt.Errorf("line %d: chain: %w", lineNo, err)
			}
			switch f[1] {
			case "-", "ACCEPT", "DROP":
			default:
				return nil, fmt.Errorf("line %d: bad policy %q", lineNo, truncate(f[1]))
			}
			if isOurChain(f[0]) && f[1] != "-" {
				// Our names are never built-in chains; a dump saying
				// otherwise cannot be reasoned about safely.
				return nil, fmt.Errorf("line %d: chain %s declared as built-in", lineNo, f[0])
			}
			if len(f) == 3 && !isCounter(f[2]) {
				return nil, fmt.Errorf("line %d: malformed counters %q", lineNo, truncate(f[2]))
			}
			if cur.Chain(f[0]) != nil {
				return nil, fmt.Errorf("line %d: chain %q declared twice", lineNo, f[0])
			}
			cur.Chains = append(cur.Chains, &SavedChain{Name: f[0], Policy: f[1]})
		default:
			if cur == nil {
				return nil, fmt.Errorf("line %d: rule outside a table", lineNo)
			}
			args, err := splitArgs(line)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", lineNo, err)
			}
			if len(args) > 0 && isCounter(args[0]) { // iptables-save -c
				args = args[1:]
			}
			if len(args) < 2 || args[0] != "-A" {
				return nil, fmt.Errorf("line %d: expected -A <chain> ..., got %q", lineNo, truncate(line))
			}
			c := cur.Chain(args[1])
			if c == nil {
				return nil, fmt.Errorf("line %d: rule for undeclared chain %q", lineNo, truncate(args[1]))
			}
			if rules++; rules > maxRulesPerTbl {
				return nil, fmt.Errorf("line %d: more than %d rules in table %q", lineNo, maxRulesPerTbl, cur.Name)
			}
			c.Rules = append(c.Rules, SavedRule{Args: args[2:]})
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("line %d: longer than %d bytes", lineNo+1, maxSaveLine)
		}
		return nil, err
	}
	if cur != nil {
		return nil, fmt.Errorf("table %q not committed", cur.Name)
	}
	return s, nil
}

// checkName accepts table, chain and policy names: short, printable, no
// spaces or quotes.
func checkName(n string) error {
	if n == "" || len(n) > maxNameLen {
		return fmt.Errorf("bad name length %d", len(n))
	}
	for i := 0; i < len(n); i++ {
		if c := n[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\'' || c == '\\' {
			return fmt.Errorf("bad character %q in name", c)
		}
	}
	return nil
}

// isCounter matches "[packets:bytes]".
func isCounter(s string) bool {
	if len(s) < 5 || s[0] != '[' || s[len(s)-1] != ']' {
		return false
	}
	p, b, ok := strings.Cut(s[1:len(s)-1], ":")
	return ok && isDigits(p) && isDigits(b)
}

func isDigits(s string) bool {
	if s == "" || len(s) > 20 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// splitArgs splits a rule line like iptables-restore does: on blanks, with
// double quotes grouping and backslash escaping inside quotes.
func splitArgs(line string) ([]string, error) {
	var args []string
	var cur strings.Builder
	inQuote, have := false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case inQuote && c == '\\':
			if i+1 >= len(line) {
				return nil, errors.New("dangling backslash")
			}
			i++
			cur.WriteByte(line[i])
		case c == '"':
			inQuote = !inQuote
			have = true
		case !inQuote && (c == ' ' || c == '\t'):
			if have {
				args = append(args, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteByte(c)
			have = true
		}
	}
	if inQuote {
		return nil, errors.New("unterminated quote")
	}
	if have {
		args = append(args, cur.String())
	}
	return args, nil
}

// joinArgs is the inverse of splitArgs, quoting only where needed.
func joinArgs(args []string) string {
	var b strings.Builder
	for i, a := range args {
		if i > 0 {
			b.WriteByte(' ')
		}
		if a != "" && !strings.ContainsAny(a, " \t\"\\") {
			b.WriteString(a)
			continue
		}
		b.WriteByte('"')
		for j := 0; j < len(a); j++ {
			if a[j] == '"' || a[j] == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(a[j])
		}
		b.WriteByte('"')
	}
	return b.String()
}

// canonical normalises a rule spec written by hand (as in PodRules) the
// same way a parsed rule's Spec is.
func canonical(spec string) string {
	args, err := splitArgs(spec)
	if err != nil {
		return spec
	}
	return joinArgs(args)
}

func truncate(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
