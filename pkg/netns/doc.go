// Package netns is every network-namespace concern of the agent, in one
// place:
//
//   - the handle on a pod's namespace (Handle: Open, Adopt, re-opened so it
//     never pins the runtime's bind mount, its Identity) and ErrInvalid, the
//     error for what can never be a pod's namespace;
//   - the path policy (Policy): which netns paths the runtime may name;
//   - discovery of running pods' namespaces (Scanner): one scan of /proc for
//     processes whose cgroup path names the pod UID, the way kubelet lays
//     cgroups out; the pod's oldest (its sandbox's) namespace, held open
//     from the moment it is checked and confirmed by the pod's addresses;
//     one scan serves a whole batch;
//   - the namespace state the capture rules depend on (State: lo up, IPv6,
//     x_tables);
//   - Do and DoInNew, the only code that moves a thread into another
//     network namespace, and Socket, the way code elsewhere gets a socket
//     inside one (a test keeps it so: no other package enters a namespace,
//     by syscall or through a library's namespace option).
//
// It imports no other package of the project.
package netns
