package app

import "k8s.io/client-go/rest"

// UserAgentPrefix starts the agent's User-Agent; the node name follows, so
// the API server's audit log tells each node's agent apart.
const UserAgentPrefix = "ambient-cni/"

// KubeClientConfig returns a copy of base (in-cluster or kubeconfig
// settings) carrying the agent's User-Agent and client-side rate limit.
// install-cni and every test that runs the agent build its client with it,
// so no test can run the agent faster than it ships.
func (c *Config) KubeClientConfig(base *rest.Config) *rest.Config {
	rc := rest.CopyConfig(base)
	rc.UserAgent = UserAgentPrefix + c.NodeName
	rc.QPS = c.KubeClientQPS
	rc.Burst = c.KubeClientBurst
	// A rate limiter of the caller's would ignore QPS and Burst.
	rc.RateLimiter = nil
	// Protobuf for the built-in types the agent reads: the pod informer's
	// watch events and every PATCH's returned Pod decode several times
	// cheaper than JSON (patch bodies keep their own content type).
	rc.AcceptContentTypes = kubeProtobuf + "," + runtimeJSON
	rc.ContentType = kubeProtobuf
	return rc
}

const (
	kubeProtobuf = "application/vnd.kubernetes.protobuf"
	runtimeJSON  = "application/json"
)
