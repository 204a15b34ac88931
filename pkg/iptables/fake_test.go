package iptables

// The package's own tests predate the exported Fake and use these names.
type (
	fakeHost = Fake
	fakeSets = FakeIPSets
)

func newFakeHost(b Backend) *Fake { return NewFake(b) }

func newFakeSets() *FakeIPSets { return NewFakeIPSets() }

func (h *Fake) takeLog() []string { return h.TakeLog() }
