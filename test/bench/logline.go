package bench

import (
	"encoding/json"
	"strconv"
	"strings"
)

// logFields reads one line of the agent's log in either of its formats
// (--log-format: slog's text, key=value with quoted values where needed,
// or JSON) into its top-level fields as text; nil if it is neither.
func logFields(line string) map[string]string {
	line = strings.TrimSpace(line)
	if strings.HasPrefix(line, "{") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) != nil {
			return nil
		}
		out := make(map[string]string, len(m))
		for k, v := range m {
			if s, ok := v.(string); ok {
				out[k] = s
			} else {
				b, _ := json.Marshal(v)
				out[k] = string(b)
			}
		}
		return out
	}
	out := map[string]string{}
	for line != "" {
		k, rest, ok := strings.Cut(line, "=")
		if !ok || k == "" || strings.ContainsAny(k, " \"") {
			return nil
		}
		var v string
		if strings.HasPrefix(rest, `"`) {
			q, err := strconv.QuotedPrefix(rest)
			if err != nil {
				return nil
			}
			v, _ = strconv.Unquote(q)
			rest = rest[len(q):]
		} else {
			v, rest, _ = strings.Cut(rest, " ")
			rest = " " + rest
		}
		out[k] = v
		line = strings.TrimLeft(rest, " ")
	}
	if out["msg"] == "" {
		return nil
	}
	return out
}
