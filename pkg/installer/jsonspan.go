package installer

import (
	"encoding/json"
	"fmt"
)

// This file locates values inside a JSON document by byte offset so the
// installer can splice its entry in and out without re-encoding anything
// that belongs to the primary CNI. Every function here expects input that
// json.Valid has already accepted, which keeps the scanner small.

// span is a half-open byte range [start, end) of one JSON value.
type span struct{ start, end int }

// member is one "key": value pair of an object.
type member struct {
	key   string // decoded key
	value span
}

// arrayLayout describes a JSON array: where its brackets are and where
// each element starts and ends.
type arrayLayout struct {
	open, close int // offsets of '[' and ']'
	elems       []span
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// skipString returns the offset just past the string starting at b[i] == '"'.
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(b)
}

// skipValue returns the offset just past the value starting at b[i]. It
// walks nested containers with a counter rather than recursion, so deep
// nesting costs no stack.
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = skipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return len(b)
	default: // number, true, false, null
		for i < len(b) {
			switch c := b[i]; {
			case c == ',' || c == '}' || c == ']' || isSpace(c):
				return i
			}
			i++
		}
		return i
	}
}

// topValue returns the span of the single top-level value of a valid document.
func topValue(b []byte) span {
	s := skipSpace(b, 0)
	return span{s, skipValue(b, s)}
}

// objectMembers lists the members of the object starting at b[i] == '{'.
func objectMembers(b []byte, i int) ([]member, error) {
	if b[i] != '{' {
		return nil, fmt.Errorf("want a JSON object, found %s", kindOf(b[i]))
	}
	var out []member
	i = skipSpace(b, i+1)
	for i < len(b) && b[i] != '}' {
		ke := skipString(b, i)
		var key string
		if err := json.Unmarshal(b[i:ke], &key); err != nil {
			return nil, fmt.Errorf("decode key: %w", err)
		}
		i = skipSpace(b, ke)
		i = skipSpace(b, i+1) // past ':'
		ve := skipValue(b, i)
		out = append(out, member{key: key, value: span{i, ve}})
		i = skipSpace(b, ve)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return out, nil
}

// arrayElems describes the array starting at b[i] == '['.
func arrayElems(b []byte, i int) (arrayLayout, error) {
	if b[i] != '[' {
		return arrayLayout{}, fmt.Errorf("want a JSON array, found %s", kindOf(b[i]))
	}
	l := arrayLayout{open: i}
	i = skipSpace(b, i+1)
	for i < len(b) && b[i] != ']' {
		e := skipValue(b, i)
		l.elems = append(l.elems, span{i, e})
		i = skipSpace(b, e)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	l.close = i
	return l, nil
}

// kindOf names the JSON kind of a value by its first byte, for errors.
func kindOf(c byte) string {
	switch c {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	default:
		return "a number"
	}
}
