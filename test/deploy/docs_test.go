package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// docPages are the Markdown pages whose relative links must resolve: the
// README, the operators' docs, the lab notes and the two maps beside the
// code.
func docPages(t *testing.T, root string) []string {
	t.Helper()
	var pages []string
	for _, pattern := range []string{"README.md", "docs/*.md", "notes/*.md", "test/README.md", "hack/README.md"} {
		m, err := filepath.Glob(filepath.Join(root, pattern))
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, m...)
	}
	if len(pages) < 3 {
		t.Fatalf("found only %d doc pages under %s", len(pages), root)
	}
	return pages
}

var (
	fencedBlock = regexp.MustCompile("(?s)```.*?```")
	mdLink      = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	mdHeading   = regexp.MustCompile(`(?m)^#{1,6} +(.+?)\s*$`)
	htmlAnchor  = regexp.MustCompile(`<a id="([^"]+)"`)
	inlineLink  = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
	notSlug     = regexp.MustCompile(`[^\p{L}\p{N}_\- ]`)
	mermaidHead = regexp.MustCompile("(?m)^```mermaid\n(.*)$")
)

// anchors are the fragment ids a page offers: its headings as GitHub
// turns them into ids (lower case, punctuation dropped, blanks to
// hyphens, a repeat numbered) and its explicit <a id> anchors.
func anchors(page string) map[string]bool {
	ids := map[string]bool{}
	for _, m := range htmlAnchor.FindAllStringSubmatch(page, -1) {
		ids[m[1]] = true
	}
	seen := map[string]int{}
	for _, m := range mdHeading.FindAllStringSubmatch(fencedBlock.ReplaceAllString(page, ""), -1) {
		h := strings.ReplaceAll(m[1], "`", "")
		h = inlineLink.ReplaceAllString(h, "$1")
		id := strings.ReplaceAll(notSlug.ReplaceAllString(strings.ToLower(h), ""), " ", "-")
		if n := seen[id]; n > 0 {
			ids[id+"-"+strconv.Itoa(n)] = true
		} else {
			ids[id] = true
		}
		seen[id]++
	}
	return ids
}

// TestDocsLinksResolve: every relative link of the docs names a file that
// exists and, with a fragment, a heading or anchor of that page, so a
// renamed page or section cannot leave a reader at a dead link.
func TestDocsLinksResolve(t *testing.T) {
	root := repoRoot(t)
	cache := map[string]map[string]bool{}
	for _, page := range docPages(t, root) {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, page)
		for _, m := range mdLink.FindAllStringSubmatch(fencedBlock.ReplaceAllString(string(b), ""), -1) {
			link := m[1]
			if strings.Contains(link, "://") || strings.HasPrefix(link, "mailto:") {
				continue
			}
			path, frag, _ := strings.Cut(link, "#")
			target := page
			if path != "" {
				target = filepath.Join(filepath.Dir(page), path)
			}
			if _, err := os.Stat(target); err != nil {
				t.Errorf("%s: link %q: %v", rel, link, err)
				continue
			}
			if frag == "" || !strings.HasSuffix(target, ".md") {
				continue
			}
			ids, ok := cache[target]
			if !ok {
				tb, err := os.ReadFile(target)
				if err != nil {
					t.Fatal(err)
				}
				ids = anchors(string(tb))
				cache[target] = ids
			}
			if !ids[frag] {
				t.Errorf("%s: link %q: no such section", rel, link)
			}
		}
	}
}

// TestDocsMermaidKinds: every mermaid drawing in the docs is of a kind the
// docs use and GitHub renders; the drawings themselves are kept simple
// (quoted labels, no styling) so that they parse.
func TestDocsMermaidKinds(t *testing.T) {
	kinds := []string{"flowchart TD", "flowchart LR", "sequenceDiagram", "stateDiagram-v2"}
	root := repoRoot(t)
	n := 0
	for _, page := range docPages(t, root) {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, page)
		for _, m := range mermaidHead.FindAllStringSubmatch(string(b), -1) {
			n++
			if kind := strings.TrimSpace(m[1]); !slices.Contains(kinds, kind) {
				t.Errorf("%s: mermaid drawing of kind %q, want one of %q", rel, kind, kinds)
			}
		}
	}
	if n == 0 {
		t.Error("no mermaid drawing found in the docs")
	}
}
