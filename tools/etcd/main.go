// Command etcd is upstream's etcd server (go.etcd.io/etcd/server/v3's etcdmain), built from Go
// modules for the sandbox's control plane. Debian 12's etcd (3.4) cannot serve the progress
// requests that kube-apiserver 1.36 needs for the watch-list streams its clients open
// (RequestWatchProgress): KWOK's and the controllers' informers then fall back and lag by a
// minute, so a DaemonSet rollout on the KWOK nodes took minutes instead of seconds.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
