// Command kube is a multi-call binary holding the Kubernetes control-plane
// programs the sandbox and the e2e tests run. It dispatches on the name it is
// called by (symlinks kube-apiserver, kube-controller-manager, kube-scheduler,
// kubectl), or on its first argument.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	_ "time/tzdata"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	cmdutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var programs = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kubectl":                 kubectl.NewDefaultKubectlCommand,
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := programs[name]; !ok && len(os.Args) > 1 {
		if _, ok := programs[os.Args[1]]; ok {
			name = os.Args[1]
			os.Args = os.Args[1:]
		}
	}
	newCommand, ok := programs[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "kube: unknown program %q; call it as one of kube-apiserver, kube-controller-manager, kube-scheduler, kubectl\n", name)
		os.Exit(2)
	}
	if name == "kubectl" {
		// kubectl prints its own errors in its own format, as upstream's main does.
		if err := cli.RunNoErrOutput(newCommand()); err != nil {
			cmdutil.CheckErr(err)
		}
		return
	}
	os.Exit(cli.Run(newCommand()))
}
