#!/usr/bin/env bash
# make release and make release-push (the Makefile sets the variables;
# docs/release.md says how to cut a release).
#
#   hack/release.sh build   the release of the VERSION file's version, for
#                           REGISTRY, into RELEASE_DIR
#   hack/release.sh push    push RELEASE_DIR's image and chart to REGISTRY,
#                           then sign them with SIGNING_KEY (attaching the
#                           signed SBOM and provenance) and verify them
#                           with RELEASE_PUBKEY
#
# build refuses a dirty tree, a VERSION_ARG (make release VERSION=...)
# other than the VERSION file, a version that is not SemVer and a
# CHANGELOG without the version's "## [X.Y.Z]" section, all before
# building anything. Then: the image index (make image), the chart with
# its default image set to REGISTRY/ambient-cni@DIGEST (make chart), the
# kubectl plugin for every platform (make kubectl-plugins), and hack/release
# assembles the rest, the image's SBOM and the release's provenance among
# them (unsigned: signatures are made when the release is pushed). Every archive's times are SOURCE_DATE_EPOCH (the
# commit's time unless set), the image's the Unix epoch (hack/imagebuild):
# two releases of one commit are byte for byte the same.
set -euo pipefail

die() { echo "make release: $*" >&2; exit 1; }

: "${GO:=go}" "${MAKE:=make}" "${RELEASE_DIR:?}"
cd "$(dirname "$0")/.."

build() {
	[ -f VERSION ] || die "no VERSION file: it holds the version a release carries (X.Y.Z)"
	local v
	v="$(tr -d '[:space:]' <VERSION)"
	if [ -n "${VERSION_ARG:-}" ] && [ "$VERSION_ARG" != "$v" ]; then
		die "VERSION=$VERSION_ARG, but the VERSION file says $v: a release is exactly the VERSION file; set it to $VERSION_ARG (and CHANGELOG's section), commit, then make release"
	fi
	local dirty
	dirty="$(git status --porcelain --untracked-files=normal)"
	if [ -n "$dirty" ]; then
		printf '%s\n' "$dirty" >&2
		die "the tree is not clean (above): a release is built from a commit; commit or stash these first"
	fi
	[ -n "${REGISTRY:-}" ] || die "REGISTRY=host[:port]/path is needed: where make release-push will push the image and the chart (your own registry until the project publishes one); the chart's default image and the manifest name REGISTRY/ambient-cni by digest"
	"$GO" run ./hack/release check -version "$v" -changelog CHANGELOG.md

	local commit epoch work
	commit="$(git rev-parse HEAD)"
	epoch="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}"
	work="$RELEASE_DIR.work"
	rm -rf "$RELEASE_DIR" "$work"
	mkdir -p "$RELEASE_DIR" "$work"
	local sub=("$MAKE" --no-print-directory "VERSION=$v" "COMMIT=$commit" "BIN=$work")

	"${sub[@]}" image IMAGE_ARCHES="$IMAGE_ARCHES" IMAGE_DIR="$RELEASE_DIR/image"
	"$GO" run ./hack/release stamp-chart -src deploy/charts/ambient-cni -out "$work/chart-src" \
		-layout "$RELEASE_DIR/image" -repository "$REGISTRY/ambient-cni"
	"${sub[@]}" chart CHART_SRC="$work/chart-src/ambient-cni" CHART_OUT="$work/chart" CHART_VERSION="$v"
	"${sub[@]}" kubectl-plugins PLUGIN_PLATFORMS="$PLUGIN_PLATFORMS"
	local bases=() a
	for a in $IMAGE_ARCHES; do
		bases+=(-base "$a=$(hack/kube-tools.sh --path "image-rootfs-$a")")
	done
	"$GO" run ./hack/release assemble -version "$v" -dir "$RELEASE_DIR" \
		"${bases[@]}" -platforms "$PLUGIN_PLATFORMS" -gosum go.sum \
		-chart "$work/chart/ambient-cni-$v.tgz" -plugins "$work" \
		-helm "$(hack/kube-tools.sh --path helm)" -registry "$REGISTRY" \
		-url "$KREW_URL" -homepage "$IMAGE_SOURCE" -commit "$commit" -epoch "$epoch"
	rm -rf "$work"
	echo "SHA256SUMS:"
	cat "$RELEASE_DIR/SHA256SUMS" | grep -v '  image/blobs/'
}

push() {
	[ -n "${REGISTRY:-}" ] || die "make release-push needs REGISTRY=host[:port]/path (the one make release was given)"
	local plain=()
	case "${PLAIN_HTTP:-}" in 1 | true) plain=(-plain-http) ;; esac
	"$GO" run ./hack/release check-key -key "${SIGNING_KEY:-}" -pub "$RELEASE_PUBKEY"
	"$GO" run ./hack/release check-push -dir "$RELEASE_DIR" -registry "$REGISTRY"
	local v tgz
	tgz="$(cd "$RELEASE_DIR" && ls ambient-cni-*.tgz)"
	v="${tgz#ambient-cni-}"
	v="${v%.tgz}"
	"$MAKE" --no-print-directory image-push REGISTRY="$REGISTRY" IMAGE_DIR="$RELEASE_DIR/image" IMAGE_TAG="$v"
	"$MAKE" --no-print-directory chart-push REGISTRY="$REGISTRY" CHART_OUT="$RELEASE_DIR" CHART_VERSION="$v" PLAIN_HTTP="${PLAIN_HTTP:-}"
	"$GO" run ./hack/release sign -dir "$RELEASE_DIR" -registry "$REGISTRY" -key "$SIGNING_KEY" -pub "$RELEASE_PUBKEY" "${plain[@]}"
}

case "${1:-}" in
build) build ;;
push) push ;;
*) die "usage: hack/release.sh build|push" ;;
esac
