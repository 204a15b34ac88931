package nodeagent_test

import (
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// The agent plugs into the real collaborators without adapters.
var (
	_ controller.Enroller        = (*nodeagent.Agent)(nil)
	_ nodeagent.Decider          = (*controller.Controller)(nil)
	_ nodeagent.EnablementSource = (*controller.Controller)(nil)
	_ nodeagent.Annotator        = controller.Annotator{}
	_ nodeagent.Ztunnel          = (*zds.Server)(nil)
	_ nodeagent.RuleApplier      = (*iptables.Applier)(nil)
)
