package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f.json")
	for _, body := range []string{"one", "two"} {
		if err := WriteFile(p, []byte(body), Options{Mode: 0o600}); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(p); string(b) != body {
			t.Errorf("content %q, want %q", b, body)
		}
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o600 {
		t.Errorf("mode %v", st.Mode())
	}
	if des, _ := os.ReadDir(dir); len(des) != 1 {
		t.Errorf("temp files left: %v", des)
	}
	if err := WriteFile(filepath.Join(dir, "missing", "f"), nil, Options{Mode: 0o600}); err == nil {
		t.Errorf("write into a missing dir succeeded")
	}
}
