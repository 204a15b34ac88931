package app_test

import (
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/controller"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/plugincred"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
)

// The agent plugs into the real collaborators without adapters.
var (
	_ controller.Agent           = (*nodeagent.Agent)(nil)
	_ controller.Finder          = netns.Scanner{}
	_ controller.Pods            = (*podcache.Cache)(nil)
	_ nodeagent.Decider          = (*podcache.Cache)(nil)
	_ nodeagent.EnablementSource = (*podcache.Cache)(nil)
	_ nodeagent.Annotator        = apicalls.Annotator{}
	_ plugincred.TokenSource     = apicalls.PluginTokens{}
	_ nodeagent.Ztunnel          = (*zds.Server)(nil)
	_ nodeagent.HostProbe        = (rulesbackend.HostProbe)(nil)
	_ ruleset.Applier            = (*iptables.Applier)(nil)
	_ ruleset.Applier            = (*nftables.Applier)(nil)
	_ rulesbackend.HostProbe     = (*iptables.HostProbe)(nil)
	_ rulesbackend.HostProbe     = (*nftables.HostProbe)(nil)
)
