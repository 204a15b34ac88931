package controller

import "k8s.io/apimachinery/pkg/types"

// Plan is plan for the external tests: whether the controller would look
// for the pod's netns to capture it, and the UID it would unenroll.
func (c *Controller) Plan(k types.NamespacedName) (capture bool, unenroll types.UID) {
	w := c.plan(k)
	return w.need, w.uid
}
