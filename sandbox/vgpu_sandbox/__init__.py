"""The local sandbox: a real Kubernetes control plane on 127.0.0.1 with simulated GPU nodes.

It runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from Go
modules by ``tools/build.sh``, KWOK for the nodes, and the product's own parts (the
extender with its kube-scheduler, one device plugin and kubelet stand-in per node).
"""
