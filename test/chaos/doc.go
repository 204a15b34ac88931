// Package chaos is the fault-injection suite of issue 12: it runs what
// ships (bin/install-cni and bin/ambient-cni from make build, with the Helm
// chart's default values, on test/lib/simnode's node, as test/bench does) against a real kube-apiserver,
// the ztunnel stand-in and pods that start and stop through the real CNI
// chain, and breaks things while they churn: the agent SIGKILLed at random
// points (seeded), ztunnel killed and restarted, the API server stopped
// for 30 seconds, 5,000 add/delete cycles, and the agent SIGKILLed at each
// step of an uninstall. After each it checks what
// production needs: every pod that should be captured is (rules, ztunnel
// workload, annotation enabled, probe-set entry), every other pod carries
// no trace of capture, and the agent leaks nothing. docs/reliability.md
// lists each failure mode, what is promised and the test that proves it.
//
// The suite takes minutes: `make test-long` runs it (AMBIENT_TEST_LONG=1),
// and `make test` skips it. It re-executes itself in a network namespace
// of its own (testnet's ProgramInOwnNetns), so its bridges, host probe set and
// API server ports collide with nothing on the machine and no traffic can
// leave it. AMBIENT_CHAOS_SEEDS=1,2,3 replays the agent-kill schedules of
// those seeds.
//
// The tests live in the _test.go files; this file only documents the
// package.
package chaos
