// Package deploy tests the deployment bundle: the Helm chart in
// deploy/charts/ambient-cni, the manifest rendered from it
// (deploy/manifests/ambient-cni.yaml, kept current by `make manifests`),
// and the image layout in deploy/Dockerfile. Helm is the real binary that
// `make tools` builds; manifests are checked by a real kube-apiserver with
// a server-side dry run; the DaemonSet's environment is parsed by the
// install-cni process's own configuration code. The docs that describe the
// bundle are checked too: every relative link of the README, docs/ and
// notes/ resolves, and each mermaid drawing is of a kind GitHub renders.
//
// The tests live in the _test.go files; this file only documents the
// package.
package deploy
