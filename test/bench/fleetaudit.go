package bench

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"strings"
	"sync"
	"time"
)

// fleetAuditPolicy logs the agents' ServiceAccount's requests (metadata
// only), with the ResponseStarted stage that only long-running requests
// have: a watch is logged when it is established as well as when it ends.
func fleetAuditPolicy(user string) string {
	return fmt.Sprintf(`apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  users: [%q]
- level: None
`, user)
}

// fleetAudit follows the audit log of many agents sharing one
// ServiceAccount, told apart by their source address (each node has its
// own): every request by verb and resource, and the watches each agent
// holds open.
type fleetAudit struct {
	user string
	// nodes names each node's address: a watch's field selector that
	// names its own node reads "<node>", so that nodes compare equal.
	nodes map[string]string

	mu   sync.Mutex
	tail logTail
	// reqs counts completed requests (watches apart) by key.
	reqs        map[string]int
	total       int
	watchStarts int
	// open are the established watches not yet ended, by audit ID.
	open map[string]openWatch
	// last is when the latest request of an agent was logged.
	last time.Time
	bad  int
}

type openWatch struct{ source, resource string }

func newFleetAudit(path, user string, nodes map[string]string) *fleetAudit {
	return &fleetAudit{user: user, nodes: nodes, tail: logTail{path: path}, reqs: map[string]int{}, open: map[string]openWatch{}}
}

func (a *fleetAudit) poll() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.tail.read(a.addLine)
}

func (a *fleetAudit) addLine(line []byte) {
	var ev auditEvent
	if err := json.Unmarshal(line, &ev); err != nil {
		a.bad++
		return
	}
	if ev.User.Username != a.user {
		return
	}
	a.last = time.Now()
	res := ""
	if ev.ObjectRef != nil {
		res = ev.ObjectRef.Resource
		if ev.ObjectRef.Subresource != "" {
			res += "/" + ev.ObjectRef.Subresource
		}
	}
	if ev.Verb == "watch" {
		switch ev.Stage {
		case "ResponseStarted":
			a.watchStarts++
			src := ""
			if len(ev.SourceIPs) > 0 {
				src = ev.SourceIPs[0]
			}
			a.open[ev.AuditID] = openWatch{source: src, resource: res + a.selectors(ev.RequestURI, src)}
		case "ResponseComplete":
			delete(a.open, ev.AuditID)
		}
		return
	}
	if ev.Stage != "ResponseComplete" {
		return
	}
	key := ev.Verb + " " + res
	if ev.ObjectRef == nil {
		// Discovery and the like: the path without its query.
		path, _, _ := strings.Cut(ev.RequestURI, "?")
		key = ev.Verb + " " + path
	}
	if ev.ResponseStatus != nil && ev.ResponseStatus.Code >= 400 {
		key += fmt.Sprintf(" (%d)", ev.ResponseStatus.Code)
	}
	a.reqs[key]++
	a.total++
}

// auditCounts is what the agents had asked up to a moment.
type auditCounts struct {
	byKey       map[string]int
	total       int
	watchStarts int
}

func (a *fleetAudit) counts() (auditCounts, error) {
	if err := a.poll(); err != nil {
		return auditCounts{}, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return auditCounts{byKey: maps.Clone(a.reqs), total: a.total, watchStarts: a.watchStarts}, nil
}

// openWatches is, per source address, the watches held open by resource.
func (a *fleetAudit) openWatches() (map[string]map[string]int, error) {
	if err := a.poll(); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[string]map[string]int{}
	for _, w := range a.open {
		if out[w.source] == nil {
			out[w.source] = map[string]int{}
		}
		out[w.source][w.resource]++
	}
	return out, nil
}

// forgetOpen drops the watches noted open: once the API server stopped,
// those it did not log as ended are gone all the same.
func (a *fleetAudit) forgetOpen() error {
	if err := a.poll(); err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.open = map[string]openWatch{}
	return nil
}

// quietFor is how long ago the agents' latest request was logged.
func (a *fleetAudit) quietFor() (time.Duration, error) {
	if err := a.poll(); err != nil {
		return 0, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.last.IsZero() {
		return time.Duration(1<<62 - 1), nil
	}
	return time.Since(a.last), nil
}

// selectors is a watch's field and label selectors, " (…)", with the
// watching node's name as "<node>"; "" when it has none.
func (a *fleetAudit) selectors(requestURI, source string) string {
	u, err := url.Parse(requestURI)
	if err != nil {
		return ""
	}
	var sel []string
	for _, k := range []string{"fieldSelector", "labelSelector"} {
		if v := u.Query().Get(k); v != "" {
			if node := a.nodes[source]; node != "" {
				v = strings.ReplaceAll(v, node, "<node>")
			}
			sel = append(sel, v)
		}
	}
	if len(sel) == 0 {
		return ""
	}
	return " (" + strings.Join(sel, "; ") + ")"
}
