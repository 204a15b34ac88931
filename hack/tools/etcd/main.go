// Command etcd is the etcd server, built from the Go module proxy so tests get
// a real etcd without a package manager or a container image.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
