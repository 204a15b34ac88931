# ambient-cni build, test and lint entry points. `make help` lists them.

GO            ?= go
# Every go command make runs builds as make build ships: static
# (CGO_ENABLED=0) and -trimpath. One build configuration, so the tests, the
# binaries and images the tests build, and lint share one compile of each
# dependency: with the tests in go's default configuration, a cold make
# check compiled client-go and the rest twice (about 300 CPU seconds).
export CGO_ENABLED ?= 0
export GOFLAGS := $(strip -trimpath $(GOFLAGS))
BIN           ?= bin
TOOLS_CACHE   ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ambient-cni/tools
STATICCHECK_VERSION ?= v0.8.2
STATICCHECK   := $(TOOLS_CACHE)/staticcheck-$(STATICCHECK_VERSION)/staticcheck
# The long suites' runner: go test -v's output as it comes, then each failed
# test's output again at the end, so the end of a CI log says why.
GOTESTSUM_VERSION ?= v1.13.0
GOTESTSUM     := $(TOOLS_CACHE)/gotestsum-$(GOTESTSUM_VERSION)/gotestsum
VERBOSE_TEST   = $(GOTESTSUM) --format standard-verbose --hide-summary=skipped --raw-command -- $(GO) test -json
# hack/kube-tools.sh and test/lib/kubeenv find etcd, kube-apiserver and helm here.
export AMBIENT_TOOLS_CACHE ?= $(TOOLS_CACHE)
# protoc-gen-go tracks the google.golang.org/protobuf version in go.mod.
PROTOC_GEN_GO_VERSION ?= v1.36.12
PROTOC_GEN_GO := $(TOOLS_CACHE)/protoc-gen-go-$(PROTOC_GEN_GO_VERSION)/protoc-gen-go
PROTOC        ?= protoc
# Test timeout for the whole suite; CI allows far more, but keep it honest.
TEST_TIMEOUT  ?= 20m
# The real-node end-to-end tests (build tag realnode) and their timeout.
E2E_TIMEOUT   ?= 45m
E2E_TEST       = $(VERBOSE_TEST) -tags realnode -count=1 -timeout $(E2E_TIMEOUT) -p 1 ./test/realnode/...
# make demo KEEP=1 leaves the node up until Ctrl-C.
KEEP          ?=
# The version every binary, the image and the chart carry: git describe
# of the checkout (a tag, or tag-N-gCOMMIT, -dirty with local changes),
# else the VERSION file, else dev. COMMIT is the full commit. make release
# is different: a release is exactly the VERSION file (docs/release.md).
VERSION       ?= $(shell git describe --tags --always --dirty 2>/dev/null || cat VERSION 2>/dev/null || echo dev)
COMMIT        ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
BUILDINFO     := github.com/ambient-cni/ambient-cni/pkg/buildinfo
STAMP_LDFLAGS := -X $(BUILDINFO).version=$(VERSION) -X $(BUILDINFO).commit=$(COMMIT)
# Both binaries ship stripped (as deploy/Dockerfile builds them): no symbol
# table or DWARF; panics still print file:line from the pclntab.
PLUGIN_LDFLAGS := -s -w $(STAMP_LDFLAGS)
AGENT_LDFLAGS  := -s -w $(STAMP_LDFLAGS)

.PHONY: deps flake archcheck tidy check check-tools all build version image image-push image-tools chart chart-push kubectl-plugins release release-push release-key verify-release test-release tools peer-tools node-tools bench bench-scale bench-agents bench-fleet test test-long test-unit fuzz e2e e2e-matrix demo demo-down lint fmt vet staticcheck generate manifests check-manifests help clean sandbox

all: build

help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

build: ## build the plugin, the agent, the uninstall hook and the kubectl plugin into ./bin, version-stamped
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='$(PLUGIN_LDFLAGS)' -o $(BIN)/ambient-cni $(PLUGIN_PKG)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='$(PLUGIN_LDFLAGS)' -o $(BIN)/ambient-cni-fallback ./cmd/ambient-cni-fallback
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='$(AGENT_LDFLAGS)' -o $(BIN)/install-cni ./cmd/install-cni
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='$(AGENT_LDFLAGS)' -o $(BIN)/ambient-cni-uninstall ./cmd/ambient-cni-uninstall
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='$(AGENT_LDFLAGS)' -o $(BIN)/kubectl-ambient_cni ./cmd/kubectl-ambient_cni

# make image: the agent's image for every architecture under one OCI index,
# built without Docker (hack/imagebuild) on the Debian bases of
# hack/kube-tools.sh image-rootfs-ARCH, written as an OCI layout directory.
IMAGE_ARCHES  ?= amd64 arm64
IMAGE_DIR     ?= $(BIN)/image
IMAGE_SOURCE  ?= https://github.com/ambient-cni/ambient-cni
# make image-push REGISTRY=host[:port]/path pushes IMAGE_DIR as
# $(REGISTRY)/ambient-cni:$(IMAGE_TAG).
REGISTRY      ?=
IMAGE_TAG     ?= $(VERSION)
PLUGIN_PKG    := ./cmd/cni-plugin

image: image-tools ## build the agent's image (linux/amd64 and linux/arm64, one index) without Docker into $(IMAGE_DIR), an OCI layout; reproducible
	@set -e; for a in $(IMAGE_ARCHES); do \
		echo "building linux/$$a binaries"; \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$a $(GO) build -trimpath -ldflags='$(PLUGIN_LDFLAGS)' -o $(BIN)/linux-$$a/ambient-cni $(PLUGIN_PKG); \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$a $(GO) build -trimpath -ldflags='$(PLUGIN_LDFLAGS)' -o $(BIN)/linux-$$a/ambient-cni-fallback ./cmd/ambient-cni-fallback; \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$a $(GO) build -trimpath -ldflags='$(AGENT_LDFLAGS)' -o $(BIN)/linux-$$a/ ./cmd/install-cni ./cmd/ambient-cni-uninstall; \
	done
	$(GO) run ./hack/imagebuild build -out $(IMAGE_DIR) -version '$(VERSION)' -revision '$(COMMIT)' -source '$(IMAGE_SOURCE)' \
		$(foreach a,$(IMAGE_ARCHES),-platform $(a)=$$(hack/kube-tools.sh --path image-rootfs-$(a)),$(BIN)/linux-$(a))

image-push: ## push $(IMAGE_DIR) (make image) to REGISTRY as ambient-cni:$(IMAGE_TAG) (credentials: docker login's config)
	@test -n '$(REGISTRY)' || { echo "make image-push needs REGISTRY=host[:port]/path"; exit 1; }
	$(GO) run ./hack/imagebuild push -layout $(IMAGE_DIR) -ref '$(REGISTRY)/ambient-cni:$(IMAGE_TAG)'

# make chart: the chart packaged with the same version. A chart version
# must be SemVer: VERSION itself when it is (a release's X.Y.Z), without
# its v for a tag (v1.2.3), or 0.0.0-VERSION when VERSION is not a tag (a
# bare commit). appVersion, and so the image tag the chart uses by
# default, is VERSION itself. CHART_SRC: make release packages a copy
# whose default image is the release's.
CHART_VERSION ?= $(shell v='$(VERSION)'; case "$$v" in ([0-9]*.[0-9]*.[0-9]*) echo "$$v";; (v[0-9]*) echo "$${v#v}";; (*) echo "0.0.0-$$v";; esac)
CHART_OUT     ?= $(BIN)/chart
CHART_SRC     ?= deploy/charts/ambient-cni

chart: ## lint and package the chart as $(CHART_OUT)/ambient-cni-$(CHART_VERSION).tgz (version and appVersion from VERSION); builds helm if needed
	GO='$(GO)' hack/kube-tools.sh helm
	@helm=$$(hack/kube-tools.sh --path helm); set -e; \
	$$helm lint --strict $(CHART_SRC); \
	$$helm package $(CHART_SRC) --version '$(CHART_VERSION)' --app-version '$(VERSION)' -d $(CHART_OUT)

# make chart-push puts the chart beside the image, under charts/ (as
# Istio publishes its charts): helm install oci://$(REGISTRY)/charts/ambient-cni.
# PLAIN_HTTP=1 for a registry without TLS (one on loopback, say); image-push
# speaks plain HTTP to a loopback registry by itself.
PLAIN_HTTP    ?=

chart-push: ## push the packaged chart (make chart) to REGISTRY as an OCI artifact: oci://$(REGISTRY)/charts/ambient-cni (PLAIN_HTTP=1: no TLS)
	@test -n '$(REGISTRY)' || { echo "make chart-push needs REGISTRY=host[:port]/path"; exit 1; }
	$$(hack/kube-tools.sh --path helm) push $(CHART_OUT)/ambient-cni-$(CHART_VERSION).tgz oci://$(REGISTRY)/charts $(if $(filter 1 true,$(PLAIN_HTTP)),--plain-http)

version: ## print the version make stamps into the binaries, the image and the chart
	@echo $(VERSION)

# make kubectl-plugins: the kubectl plugin for every platform operators
# run kubectl on, static, as make build stamps it.
PLUGIN_PLATFORMS ?= linux/amd64 linux/arm64 darwin/amd64 darwin/arm64

kubectl-plugins: ## build the kubectl plugin for $(PLUGIN_PLATFORMS) into $(BIN)/kubectl-OS-ARCH/
	@set -e; for p in $(PLUGIN_PLATFORMS); do \
		os=$${p%/*}; arch=$${p#*/}; echo "building the kubectl plugin for $$os/$$arch"; \
		CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch $(GO) build -trimpath -ldflags='$(AGENT_LDFLAGS)' -o $(BIN)/kubectl-$$os-$$arch/kubectl-ambient_cni ./cmd/kubectl-ambient_cni; \
	done

# make release: everything a release ships, from a clean tree, into
# RELEASE_DIR (gitignored); the version is the VERSION file's, and
# VERSION=X.Y.Z on the command line must agree with it. REGISTRY is where
# make release-push will push (the operator's own registry until the
# project publishes one): the chart's default image and the manifest name
# REGISTRY/ambient-cni by digest. Archive times are SOURCE_DATE_EPOCH, by
# default the commit's time; hack/release.sh says every step and
# docs/release.md how to cut a release.
RELEASE_VERSION = $(shell cat VERSION 2>/dev/null)
RELEASE_DIR   ?= $(BIN)/release/$(RELEASE_VERSION)
# krew's uri: where the kubectl plugin's archives are published.
KREW_URL      ?= $(IMAGE_SOURCE)/releases/download/v$(RELEASE_VERSION)

release: ## from a clean tree: the image index, chart, digest-pinned manifest, kubectl plugin archives + krew manifest, notes and SHA256SUMS of the VERSION file's version, for REGISTRY, into bin/release/VERSION (reproducible)
	@GO='$(GO)' MAKE='$(MAKE)' VERSION_ARG='$(if $(filter command line environment,$(origin VERSION)),$(VERSION))' \
	REGISTRY='$(REGISTRY)' RELEASE_DIR='$(RELEASE_DIR)' KREW_URL='$(KREW_URL)' IMAGE_SOURCE='$(IMAGE_SOURCE)' \
	IMAGE_ARCHES='$(IMAGE_ARCHES)' PLUGIN_PLATFORMS='$(PLUGIN_PLATFORMS)' hack/release.sh build

release-push: ## push make release's image and chart to REGISTRY (the one the release was made for), sign them with SIGNING_KEY (with the SBOM and provenance attached), verify and print their digests
	@GO='$(GO)' MAKE='$(MAKE)' REGISTRY='$(REGISTRY)' RELEASE_DIR='$(RELEASE_DIR)' PLAIN_HTTP='$(PLAIN_HTTP)' \
	SIGNING_KEY='$(SIGNING_KEY)' RELEASE_PUBKEY='$(RELEASE_PUBKEY)' hack/release.sh push

# Signing (docs/release.md#signing): SIGNING_KEY is the release key's
# private half, kept outside the tree, its password in COSIGN_PASSWORD;
# RELEASE_PUBKEY its public half, committed, what every verifier uses.
SIGNING_KEY    ?=
RELEASE_PUBKEY ?= deploy/release/cosign.pub

release-key: ## make the release key pair: the private key to SIGNING_KEY (outside the tree, encrypted with COSIGN_PASSWORD), the public key to RELEASE_PUBKEY (commit it)
	$(GO) run ./hack/release keygen -private '$(SIGNING_KEY)' -pub '$(RELEASE_PUBKEY)'

verify-release: ## before installing: verify the signatures of REGISTRY's ambient-cni image and chart of the VERSION file's version, and the image's SBOM and provenance, with RELEASE_PUBKEY; prints the digests to install by
	@test -n '$(REGISTRY)' || { echo "make verify-release needs REGISTRY=host[:port]/path"; exit 1; }
	$(GO) run ./hack/release verify -key '$(RELEASE_PUBKEY)' $(if $(filter 1 true,$(PLAIN_HTTP)),-plain-http) \
		-image '$(REGISTRY)/ambient-cni:$(RELEASE_VERSION)' -chart '$(REGISTRY)/charts/ambient-cni:$(RELEASE_VERSION)'

tools: ## build etcd, kube-apiserver, helm and promtool (the alert rules' tests) from the Go module proxy into the tools cache (minutes the first time, with a line every 30 s saying the time left; then cached)
	GO='$(GO)' hack/kube-tools.sh

# make test's quick bench runs Istio's istio-cni beside ours too.
peer-tools: ## build Istio's istio-cni (install-cni, its plugin and chart) of the default Istio minor from its source into the tools cache, for make bench's peer column (cached)
	GO='$(GO)' hack/kube-tools.sh istio-cni

image-tools: ## build make image's Debian bases (hack/kube-tools.sh image-rootfs-ARCH, one per architecture) into the tools cache
	GO='$(GO)' hack/kube-tools.sh $(addprefix image-rootfs-,$(IMAGE_ARCHES))

# ISTIO_CNI_IN_NODE_TOOLS (make check sets it): node-tools builds Istio's
# istio-cni too, right after istiod, and make test does not build it first
# (TEST_PEER_TOOLS, below).
ISTIO_CNI_IN_NODE_TOOLS ?=

node-tools: ## build everything a real node needs: kubelet, kube-controller-manager, kube-scheduler, kubectl (one go build), crictl, containerd, runc, CNI plugins, the Multus thin plugin, flannel, the image's Debian rootfs, istiod (the default Istio minor's), the Prometheus server, the registry (cached; a line every 30 s with the time left)
	GO='$(GO)' hack/kube-tools.sh node $(if $(ISTIO_CNI_IN_NODE_TOOLS),istio-cni)

# Where make bench writes its JSON (gitignored).
BENCH_OUT     ?= .bench

# A profiled run keeps the agent's symbol table: perf symbolizes from it.
bench: AGENT_LDFLAGS := $(if $(filter 1 true,$(BENCH_PROFILE)),,-s -w) $(STAMP_LDFLAGS)
bench: build tools peer-tools ## as root: measure the shipped binaries with the chart's defaults beside Istio's istio-cni (built into the tools cache on first use), print one table (docs/performance.md); JSON in .bench/; BENCH_QUICK=1 for a smoke run, BENCH_PROFILE=1 to attach perf
	$(GO) run ./test/bench/cmd/bench -install-cni $(BIN)/install-cni -plugin $(BIN)/ambient-cni -out $(BENCH_OUT)

bench-scale: build tools ## as root: the agent's RSS idle and with 10,000 namespaces (10 KiB of annotations each) and 20,000 pods of other nodes in the API server, against its targets (docs/performance.md); BENCH_QUICK=1 for a smoke run
	$(GO) run ./test/bench/cmd/bench -scale -install-cni $(BIN)/install-cni -plugin $(BIN)/ambient-cni -out $(BENCH_OUT)

# How many node agents make bench-agents runs of each system.
BENCH_AGENTS  ?= 50
bench-agents: build tools peer-tools ## as root: what BENCH_AGENTS (50) node agents, each on a simulated node, cost one API server (requests, watches, memory, CPU at start, at rest, at a namespace flip), ours beside istio-cni's (docs/performance.md); BENCH_QUICK=1 for a smoke run
	$(GO) run ./test/bench/cmd/bench -agents $(BENCH_AGENTS) -install-cni $(BIN)/install-cni -plugin $(BIN)/ambient-cni -out $(BENCH_OUT)

# The fleet sizes make bench-fleet simulates, comma-separated.
BENCH_FLEET ?= 100,1000
bench-fleet: tools peer-tools ## what BENCH_FLEET (100,1000) simulated node agents of each system (the agent's own watch set, one process) cost one API server: at rest, a namespace flip, DaemonSet status writes, a restart wave, ours beside istio-cni's (docs/performance.md); about 15 minutes on 2 shared cores; BENCH_QUICK=1 for a smoke run
	$(GO) run ./test/bench/cmd/bench -fleet $(BENCH_FLEET) -out $(BENCH_OUT)

# make deps: the Debian packages make check and make demo need (the list,
# and why each: hack/deps.sh --list). As root it installs what is missing;
# when nothing is, it prints one line and touches nothing.
deps: ## as root: install the Debian packages make check and make demo need (apt-get; one line and nothing else when all are there)
	@hack/deps.sh

# make check runs its stages in this order, each a make of its own, and
# stops at the first failure (make -k: goes on). bg:STAGE starts a stage in
# the background (its lines prefixed [STAGE]) and wait:STAGE waits for it
# (a failed one fails make check there, with the end of its log). The
# critical path is the tools, then the real node's e2e, which mostly waits
# on the node (a core left idle). So the e2e starts as soon as
# check-tools is done, beside node-tools and make test (each e2e test
# waits for the tools it needs), and lint and the fault-injection suite
# run after make test, still beside the e2e. The critical path comes
# first for the CPU: node-tools and the e2e run at nice 0, make test at 10
# (STAGE_NICE_test), lint and the fault-injection suite at 19: beside a
# cold make test at the same priority, the e2e waited 14 minutes for the
# node's tools and its tests took half as long again. make test's suites and the chaos
# suite's nodes live in network namespaces of their own and never touch a
# real node's paths (make test checks it); the real node keeps its files
# under its own directory, its ports outside the ephemeral range.
# hack/stages.sh times the stages when STAGE_TIMES names a file: .ci/run
# prints the table.
CHECK_STAGES  := check-tools bg:node-tools bg:e2e-beside-tools test bg:lint bg:test-long wait:node-tools wait:e2e-beside-tools wait:lint wait:test-long

check: deps ## as root: everything CI runs (.ci/run runs exactly this): check-tools, then e2e and node-tools in the background beside test, then lint and test-long beside the e2e
	@ISTIO_CNI_IN_NODE_TOOLS=1 STAGE_BG_NICE_node_tools=0 STAGE_BG_NICE_e2e_beside_tools=0 STAGE_NICE_test=10 MAKE='$(MAKE)' KEEP_GOING='$(findstring k,$(firstword -$(MAKEFLAGS)))' hack/stages.sh make $(CHECK_STAGES)

# The tools every later stage of make check needs first (the real node's
# API server, helm, the image bases), in one run of hack/kube-tools.sh: on
# a cold cache the Debian bases and the module downloads then overlap the
# Go builds. promtool (make test's) and the Prometheus server (the real
# node's) build here too, in one go build: built apart, make test's
# promtool at nice 10 and node-tools' server overlapped and compiled the
# same packages twice, and make test waited 22 minutes for its promtool.
# The rest builds beside the e2e and make test, in make node-tools: the
# real node's, with Istio's istio-cni right after istiod (the e2e's switch
# tests and make test's bench wait for it if it is still building).
# gotestsum (for make e2e and make test-long) builds beside them: its
# build is mostly module downloads.
check-tools: ## build the tools every stage of make check needs first into the tools cache, downloads overlapping the builds
	@$(MAKE) --no-print-directory $(GOTESTSUM) & gts=$$!; \
	GO='$(GO)' hack/kube-tools.sh etcd kube-apiserver helm promtool prometheus $(addprefix image-rootfs-,$(IMAGE_ARCHES)); rc=$$?; \
	wait $$gts || rc=1; exit $$rc

# The suite must leave a real node's paths (/var/run/ambient-cni, /var/lib/ambient-cni,
# /etc/cni/net.d, /opt/cni/bin, /var/run/ztunnel) as it found them:
# hack/node-paths.sh lists them before and compares after; hack/leftovers.sh
# does the same for the sandboxes tests make (named netns, pod cgroups).
# Go native fuzz targets (hack/fuzz.sh): go test replays each one's seeds;
# make test then fuzzes each for TEST_FUZZTIME (empty, the default: not at
# all), make fuzz for FUZZTIME. Off in make test because fuzzing builds an
# instrumented copy of every dependency (client-go included): about 23
# minutes of a cold CI on two cores for one second of fuzzing per target.
FUZZTIME      ?= 60s
TEST_FUZZTIME ?=
# Istio's istio-cni, for make test's bench (its peer column). make check
# builds it in node-tools (ISTIO_CNI_IN_NODE_TOOLS), right after istiod,
# most of their packages shared, instead of at make test's start: built
# there at make test's nice 10 beside istiod, it compiled their common
# packages twice and held make test back 20 minutes of a cold run; the
# bench waits for it (test/bench's IstioBinaries) while the other
# packages run.
TEST_PEER_TOOLS := $(if $(ISTIO_CNI_IN_NODE_TOOLS),,peer-tools)

test: tools $(TEST_PEER_TOOLS) image-tools check-manifests ## run every test (root tests need root; CI=true turns skips into failures), then each fuzz target for TEST_FUZZTIME if set; fails if a test touched a real node's paths or left a sandbox behind
	@snap=$$(mktemp); left=$$(mktemp); hack/node-paths.sh snapshot $$snap; hack/leftovers.sh snapshot $$left; \
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...; rc=$$?; \
	{ [ -z '$(TEST_FUZZTIME)' ] || GO='$(GO)' FUZZTIME='$(TEST_FUZZTIME)' hack/fuzz.sh; } || rc=1; \
	hack/node-paths.sh check $$snap || rc=1; hack/leftovers.sh check $$left || rc=1; rm -f $$snap $$left; exit $$rc

fuzz: ## run every Go fuzz target for FUZZTIME (60s) each; a failing input lands in the package's testdata/fuzz/, which go test then replays
	GO='$(GO)' FUZZTIME='$(FUZZTIME)' hack/fuzz.sh

# The fault-injection suite (test/chaos, docs/reliability.md) takes
# minutes (its scenarios run side by side, each in a network namespace of
# its own), so make test skips it; CI runs both. The timeout is a hang
# guard, not a budget: beside make check's e2e the soak's 5,100 cycles
# ran at 3.5 a second, 29 minutes with its setup, and under 30m its time
# ran out with the cycles nearly done.
LONG_TIMEOUT  ?= 60m

test-long: tools $(GOTESTSUM) ## as root: the fault-injection suite (agent SIGKILLs, ztunnel and API server outages, a 5,000-cycle soak; AMBIENT_CHAOS_SEEDS=1,2 replays kill schedules)
	@left=$$(mktemp); hack/leftovers.sh snapshot $$left; \
	AMBIENT_TEST_LONG=1 $(VERBOSE_TEST) -count=1 -timeout $(LONG_TIMEOUT) ./test/chaos/; rc=$$?; \
	hack/leftovers.sh check $$left || rc=1; rm -f $$left; exit $$rc

# A static binary, so Ctrl-C reaches it directly (not through go run) and
# it tears the node down before make returns.
$(BIN)/ambient-node: FORCE
	CGO_ENABLED=0 $(GO) build -trimpath -o $@ ./test/realnode/cmd/node

demo: deps node-tools $(BIN)/ambient-node ## as root: a real kubelet + containerd node, ambient-cni installed by helm, the story with checked proofs, then teardown (KEEP=1: stay up to explore)
	$(BIN)/ambient-node demo $(if $(KEEP),-keep)

demo-down: $(BIN)/ambient-node ## tear down a node whose demo was killed (Ctrl-C tears down by itself)
	$(BIN)/ambient-node down

e2e: node-tools peer-tools image-tools $(GOTESTSUM) ## as root: the end-to-end tests on a real node (kubelet, containerd, helm-installed DaemonSet; Istio's istio-cni for the switch from it)
	$(E2E_TEST)

# Istio's minors make e2e-matrix runs the Istio suites against: every one
# hack/kube-tools.sh builds (the released minors from their tags' source,
# and istio.io/istio's master as next), the default (make check's) first.
ISTIO_MINORS    ?= $(shell hack/kube-tools.sh --istio-minors)
E2E_MATRIX_RUN  := ^(TestRealNodeSwitch|TestRealNodeIstiod)$$

e2e-matrix: node-tools image-tools $(GOTESTSUM) ## as root: the real node's Istio suites (the switch from Istio's istio-cni and back, istiod's view of the pods) against each of Istio's minors (ISTIO_MINORS), one after another, then a line per minor; builds each minor's istiod and istio-cni first (cached)
	@rc=0; sum=""; for m in $(ISTIO_MINORS); do \
		echo "== e2e-matrix: Istio $$m"; \
		if GO='$(GO)' hack/kube-tools.sh istiod-$$m istio-cni-$$m && \
			AMBIENT_ISTIO=$$m $(VERBOSE_TEST) -tags realnode -count=1 -timeout $(E2E_TIMEOUT) -p 1 -run '$(E2E_MATRIX_RUN)' ./test/realnode/; \
		then sum="$$sum\n  Istio $$m: passed"; else sum="$$sum\n  Istio $$m: FAILED"; rc=1; fi; \
	done; printf "e2e-matrix:$$sum\n"; exit $$rc

# make check's e2e: the same tests, started while bg:node-tools still
# builds; a test that needs a tool that build has not finished waits for it
# (test/lib/kubeenv AwaitTool). Its timeout counts that wait too: from a
# cold cache the e2e took 40 minutes, 14 of them waiting; 70 minutes
# after check-tools is still inside CI's 90.
e2e-beside-tools: E2E_TIMEOUT := 70m
e2e-beside-tools: $(GOTESTSUM)
	$(E2E_TEST)

# make test-release builds a whole release twice and compares the two
# (test/release): minutes warm, and the first darwin builds of a cold
# cache many more, so make check leaves it to the release's own checks
# (docs/release.md); make test runs its refusals.
test-release: image-tools ## build make release twice into two trees and compare every artifact byte for byte, then push to a loopback registry, sign, verify and pull it back; then a signed release whose tampering verification refuses
	AMBIENT_TEST_RELEASE=1 $(GO) test -count=1 -timeout 40m -v -run '^(TestReleaseReproducible|TestReleaseSigned)$$' ./test/release/

# make flake RUN=TestX PKG=./test/chaos/ [N=20] [LOAD=2] [TAGS=realnode]
# [SHOW=regexp]: one test run N times, under LOAD busy loops, each run's
# log lines SHOW matches printed (hack/flake.sh).
N             ?= 20
LOAD          ?= 0
RUN           ?=
PKG           ?=
TAGS          ?=
SHOW          ?=
FLAKE_TIMEOUT ?= 30m

flake: ## run one test N times (RUN=regexp PKG=./pkg/ N=20, LOAD=2 busy loops beside it, TAGS=realnode, SHOW=regexp of log lines to print): passes, failures and the failed runs' logs
	@GO='$(GO)' hack/flake.sh -run '$(RUN)' -n '$(N)' -load '$(LOAD)' -tags '$(TAGS)' -timeout '$(FLAKE_TIMEOUT)' -show '$(SHOW)' $(PKG)

test-unit: ## run the tests that need neither root nor built tools
	AMBIENT_UNIT_ONLY=1 $(GO) test -count=1 ./...

lint: fmt vet staticcheck archcheck tidy ## gofmt, go vet, staticcheck, the import rules of docs/architecture.md and a tidy go.mod

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet -tags realnode ./...

# The package table of docs/architecture.md is the one source of the import
# rules; archcheck fails on an import it does not allow and on an allowance
# no import uses.
archcheck:
	GO='$(GO)' $(GO) run ./hack/archcheck

# go.mod and go.sum must be what go mod tidy writes: a direct import marked
# indirect, or a requirement nothing uses, fails lint (the diff is printed).
tidy:
	$(GO) mod tidy -diff

staticcheck: $(STATICCHECK)
	$(STATICCHECK) -tags realnode ./...

$(STATICCHECK):
	GOBIN=$(dir $(STATICCHECK)) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

$(GOTESTSUM):
	GOBIN=$(dir $(GOTESTSUM)) $(GO) install gotest.tools/gotestsum@$(GOTESTSUM_VERSION)

generate: $(PROTOC_GEN_GO) ## regenerate committed protobuf Go code (needs protoc: Debian protobuf-compiler)
	$(PROTOC) --plugin=protoc-gen-go=$(PROTOC_GEN_GO) -I pkg/ambient/zdspb \
		--go_out=pkg/ambient/zdspb --go_opt=paths=source_relative pkg/ambient/zdspb/zds.proto

# The chart is the source; the manifest is its helm template output, and
# test/deploy/testdata/platform-*.yaml its output per platform. The release
# name, namespace and header live in one place: test/deploy, whose
# TestManifestUpToDate and TestPlatformGoldens rewrite the files when
# UPDATE_MANIFESTS=1.
MANIFEST_TEST := -count=1 -run '^(TestManifestUpToDate|TestPlatformGoldens)$$' ./test/deploy

manifests: ## render deploy/manifests/ambient-cni.yaml and the per-platform goldens from deploy/charts/ambient-cni (helm template; builds helm if needed)
	GO='$(GO)' hack/kube-tools.sh helm
	UPDATE_MANIFESTS=1 $(GO) test $(MANIFEST_TEST)

check-manifests: ## fail unless deploy/manifests/ambient-cni.yaml is what the chart renders (run by make test)
	GO='$(GO)' hack/kube-tools.sh helm
	CI=true $(GO) test $(MANIFEST_TEST)

$(PROTOC_GEN_GO):
	GOBIN=$(dir $(PROTOC_GEN_GO)) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

clean:
	rm -rf $(BIN)

FORCE:

sandbox: build tools ## run the main job locally as root: API server, install-cni, ztunnel stand-in, pods
	$(GO) run ./test/sandbox/cmd/sandbox -install-cni $(BIN)/install-cni
