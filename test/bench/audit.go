package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
)

// API requests are counted from the API server's audit log: every request
// the agent's ServiceAccount makes is logged once, when its response is
// complete, with its User-Agent. The agent is not touched and no proxy
// sits between it and the API server. Watches are long-running requests,
// logged when they end; they are counted apart.

// auditPolicy logs the agent's ServiceAccount's requests (metadata only)
// and nothing else.
func auditPolicy(users ...string) string {
	quoted := make([]string, len(users))
	for i, u := range users {
		quoted[i] = strconv.Quote(u)
	}
	return fmt.Sprintf(`apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
- level: Metadata
  users: [%s]
- level: None
`, strings.Join(quoted, ", "))
}

// auditArgs are the kube-apiserver flags that write the log; blocking mode
// writes each event before the request's response completes.
func auditArgs(policyPath, logPath string) []string {
	return []string{
		"--audit-policy-file=" + policyPath,
		"--audit-log-path=" + logPath,
		"--audit-log-format=json",
		"--audit-log-mode=blocking",
		"--audit-log-maxsize=0",
	}
}

// APIRequest is one request of the agent, as the audit log shows it.
type APIRequest struct {
	Verb, Resource, Subresource string
	Code                        int
	// Server is the time the API server took (received to complete).
	Server time.Duration
}

// Key is "verb resource[/subresource]".
func (r APIRequest) Key() string {
	k := r.Verb + " " + r.Resource
	if r.Subresource != "" {
		k += "/" + r.Subresource
	}
	return k
}

type auditEvent struct {
	AuditID    string   `json:"auditID"`
	RequestURI string   `json:"requestURI"`
	SourceIPs  []string `json:"sourceIPs"`
	Stage      string   `json:"stage"`
	Verb       string   `json:"verb"`
	UserAgent  string   `json:"userAgent"`
	User       struct {
		Username string `json:"username"`
	} `json:"user"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	Received time.Time `json:"requestReceivedTimestamp"`
	Done     time.Time `json:"stageTimestamp"`
}

// auditLog follows the audit log file and keeps the agent's requests.
type auditLog struct {
	tail      logTail
	userAgent string
	// user, when set, matches by the authenticated user instead (a peer
	// whose User-Agent is not ours to know).
	user string

	mu      sync.Mutex
	reqs    []APIRequest
	watches int
	bad     int
}

func newAuditLog(path, node string) *auditLog {
	return &auditLog{tail: logTail{path: path}, userAgent: installcni.UserAgentPrefix + node}
}

func newAuditLogUser(path, user string) *auditLog {
	return &auditLog{tail: logTail{path: path}, user: user}
}

// poll reads what was appended since the last call.
func (a *auditLog) poll() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.tail.read(a.addLine)
}

// logTail reads the lines appended to a growing file since its last
// read; a line not yet complete waits for the next.
type logTail struct {
	path    string
	off     int64
	partial []byte
}

// read calls line for each complete line appended since the last read.
func (t *logTail) read(line func([]byte)) error {
	f, err := os.Open(t.path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Seek(t.off, io.SeekStart); err != nil {
		return err
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	t.off += int64(len(b))
	b = append(t.partial, b...)
	last := bytes.LastIndexByte(b, '\n')
	if last < 0 {
		t.partial = b
		return nil
	}
	t.partial = append([]byte(nil), b[last+1:]...)
	sc := bufio.NewScanner(bytes.NewReader(b[:last+1]))
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		line(sc.Bytes())
	}
	return sc.Err()
}

func (a *auditLog) addLine(line []byte) {
	var ev auditEvent
	if err := json.Unmarshal(line, &ev); err != nil {
		a.bad++
		return
	}
	// The client appends nothing to the configured User-Agent; a prefix
	// match would also take another node's "ambient-cni/<node>-2".
	if ev.Stage != "ResponseComplete" || (a.user == "" && ev.UserAgent != a.userAgent) || (a.user != "" && ev.User.Username != a.user) {
		return
	}
	if ev.Verb == "watch" {
		a.watches++
		return
	}
	r := APIRequest{Verb: ev.Verb}
	if ev.ObjectRef != nil {
		r.Resource, r.Subresource = ev.ObjectRef.Resource, ev.ObjectRef.Subresource
	}
	if ev.ResponseStatus != nil {
		r.Code = ev.ResponseStatus.Code
	}
	if !ev.Received.IsZero() && ev.Done.After(ev.Received) {
		r.Server = ev.Done.Sub(ev.Received)
	}
	a.reqs = append(a.reqs, r)
}

// mark is the position to pass to since.
func (a *auditLog) mark() (int, error) {
	if err := a.poll(); err != nil {
		return 0, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.reqs), nil
}

// since returns the requests logged after mark.
func (a *auditLog) since(mark int) []APIRequest {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]APIRequest(nil), a.reqs[mark:]...)
}

// meanServerMs is the API server's mean time per request.
func meanServerMs(reqs []APIRequest) float64 {
	if len(reqs) == 0 {
		return 0
	}
	var sum time.Duration
	for _, r := range reqs {
		sum += r.Server
	}
	return ms(sum) / float64(len(reqs))
}

// summarize counts requests by Key.
func summarize(reqs []APIRequest) map[string]int {
	out := map[string]int{}
	for _, r := range reqs {
		k := r.Key()
		if r.Code >= 400 {
			k += " (" + fmt.Sprint(r.Code) + ")"
		}
		out[strings.TrimSpace(k)]++
	}
	return out
}
