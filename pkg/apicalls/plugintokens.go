package apicalls

import (
	"context"
	"errors"
	"fmt"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"

	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
)

// PluginTokens issues the plugin's own tokens (package plugincred's
// TokenSource): tokens of the plugin's ServiceAccount, which may only read
// pods, namespaces, nodes and the agent's DaemonSet, bound to this node, so the API server rejects them
// once the node object is deleted, and expiring.
type PluginTokens struct {
	Client kubeclient.ServiceAccountTokens
	// Namespace and ServiceAccount name the plugin's ServiceAccount.
	Namespace, ServiceAccount string
	// NodeName is the node the tokens are bound to.
	NodeName string
}

// Token asks the TokenRequest API for a token valid for lifetime, and
// returns it with the expiry the API server granted (its
// --service-account-max-token-expiration may shorten the lifetime).
func (p PluginTokens) Token(ctx context.Context, lifetime time.Duration) (plugincred.Token, error) {
	secs := int64(lifetime / time.Second)
	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: &secs,
		BoundObjectRef:    &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Node", Name: p.NodeName},
	}}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := p.Client.CreateToken(ctx, p.Namespace, p.ServiceAccount, tr)
	if err != nil {
		return plugincred.Token{}, fmt.Errorf("token for ServiceAccount %s/%s bound to node %s: %w", p.Namespace, p.ServiceAccount, p.NodeName, err)
	}
	if out.Status.Token == "" {
		return plugincred.Token{}, errors.New("TokenRequest answered no token")
	}
	return plugincred.Token{Value: out.Status.Token, Expires: out.Status.ExpirationTimestamp.Time}, nil
}
