package deploy

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// dockerfile holds the parts of deploy/Dockerfile the chart depends on.
type dockerfile struct {
	builds     map[string]string // output -> package, of every go build -o
	copies     map[string]string // image path -> build output, of COPY --from
	entrypoint []string
	packages   []string // apt-get install
	runs       []string
	// versionArgs are the ARG VERSION lines' arguments (VERSION=default).
	versionArgs []string
}

func parseDockerfile(t testing.TB) dockerfile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "deploy", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	// One instruction per line: join continuations, drop comments.
	var lines []string
	var cur strings.Builder
	for l := range strings.SplitSeq(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "#") {
			continue
		}
		if s, ok := strings.CutSuffix(l, "\\"); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(l)
		if s := strings.TrimSpace(cur.String()); s != "" {
			lines = append(lines, s)
		}
		cur.Reset()
	}
	d := dockerfile{builds: map[string]string{}, copies: map[string]string{}}
	build := regexp.MustCompile(`CGO_ENABLED=0 [^&]*go build [^&]*-o (\S+) (\./cmd/\S+)`)
	for _, l := range lines {
		instr, rest, _ := strings.Cut(l, " ")
		switch strings.ToUpper(instr) {
		case "RUN":
			d.runs = append(d.runs, rest)
			for _, m := range build.FindAllStringSubmatch(rest, -1) {
				d.builds[m[1]] = m[2]
			}
			if _, pkgs, ok := strings.Cut(rest, "apt-get install "); ok {
				pkgs, _, _ = strings.Cut(pkgs, "&&")
				for _, f := range strings.Fields(pkgs) {
					if !strings.HasPrefix(f, "-") {
						d.packages = append(d.packages, f)
					}
				}
			}
		case "COPY":
			f := strings.Fields(rest)
			if len(f) == 3 && strings.HasPrefix(f[0], "--from=") {
				d.copies[f[2]] = f[1]
			}
		case "ARG":
			if rest == "VERSION" || strings.HasPrefix(rest, "VERSION=") {
				d.versionArgs = append(d.versionArgs, rest)
			}
		case "ENTRYPOINT":
			if err := json.Unmarshal([]byte(rest), &d.entrypoint); err != nil {
				t.Fatalf("ENTRYPOINT %s: want exec form: %v", rest, err)
			}
		}
	}
	return d
}

// The image holds the binaries where the chart looks for them, built
// static from the right packages, and the netfilter tools.
func TestDockerfileMatchesChart(t *testing.T) {
	d := parseDockerfile(t)
	defaults := readYAML(t, filepath.Join(chartDir, "values.yaml"))
	cmd, _ := lookup(defaults, "image.command")
	plugin, _ := lookup(defaults, "image.pluginBinary")
	o := decode(t, readManifest(t))
	if got := o.config(t).PluginBinary; got != plugin {
		t.Errorf("manifest AMBIENT_PLUGIN_BINARY %s, values image.pluginBinary %v", got, plugin)
	}
	if got := o.container(t).Command; !slices.Equal(got, []string{cmd.(string)}) {
		t.Errorf("manifest command %v, values image.command %v", got, cmd)
	}
	uninstall, _ := lookup(defaults, "image.uninstallCommand")
	fallback := filepath.Join(filepath.Dir(plugin.(string)), "ambient-cni-fallback")
	for path, pkg := range map[string]string{plugin.(string): "./cmd/cni-plugin", cmd.(string): "./cmd/install-cni", uninstall.(string): "./cmd/ambient-cni-uninstall", fallback: "./cmd/ambient-cni-fallback"} {
		out, ok := d.copies[path]
		if !ok {
			t.Errorf("the image has nothing at %s (COPY targets %v)", path, d.copies)
			continue
		}
		if d.builds[out] != pkg {
			t.Errorf("%s in the image is %s, built from %q; want a static build of %s", path, out, d.builds[out], pkg)
		}
		if _, err := os.Stat(filepath.Join(repoRoot(t), pkg)); err != nil {
			t.Errorf("%s: %v", pkg, err)
		}
	}
	if !slices.Equal(d.entrypoint, []string{cmd.(string)}) {
		t.Errorf("ENTRYPOINT %v, want [%v]", d.entrypoint, cmd)
	}
	for _, p := range []string{"iptables", "nftables", "ipset"} {
		if !slices.Contains(d.packages, p) {
			t.Errorf("image lacks Debian package %s (installs %v)", p, d.packages)
		}
	}
}

// docker build without --build-arg VERSION fails, before downloading
// anything, with the argument to pass, rather than stamp a made-up
// version (a label cannot read the VERSION file); given one, it goes on.
func TestDockerfileNeedsVersion(t *testing.T) {
	d := parseDockerfile(t)
	if len(d.versionArgs) != 2 {
		t.Fatalf("ARG VERSION lines %q, want one per stage", d.versionArgs)
	}
	for _, a := range d.versionArgs {
		if a != "VERSION" {
			t.Errorf("ARG %s: want no default (a default version is made up)", a)
		}
	}
	var guard string
	for _, r := range d.runs {
		if strings.Contains(r, "--build-arg VERSION=") {
			guard = r
		}
	}
	if guard == "" {
		t.Fatal("no RUN refuses a build without VERSION")
	}
	for _, v := range []string{"", "1.2.3"} {
		cmd := exec.Command("sh", "-c", guard)
		cmd.Env = []string{"VERSION=" + v}
		out, err := cmd.CombinedOutput()
		if v == "" && (err == nil || !strings.Contains(string(out), "needs --build-arg VERSION=$(cat VERSION)")) {
			t.Errorf("without VERSION: %v %q, want refused naming the argument", err, out)
		}
		if v != "" && err != nil {
			t.Errorf("VERSION=%s: %v %q", v, err, out)
		}
	}
}
