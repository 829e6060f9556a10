// Command kubelet is the upstream kubelet, built from Go modules at the
// sandbox's Kubernetes pin, for the sandbox's real node
// (`vgpu sandbox up --real-node`). Kept apart from tools/kube so that its
// dependencies (cadvisor, the CRI client, runc's cgroup code) never move the
// control plane's pins, and so that machines without a real node never build it.
package main

import (
	"context"
	"os"

	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
