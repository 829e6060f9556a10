"""The sandbox's real node: the upstream kubelet, containerd and runc on this machine.

``vgpu sandbox up --real-node`` adds, beside the KWOK nodes, one node (``real-node-0``) that runs
pods for real: containerd 2 built from Go modules (``tools/build.sh containerd``: containerd, its
runc shim and ctr) with its own configuration, root, state and socket under the sandbox's folder
and CDI on (``/etc/cdi``, ``/var/run/cdi``), runc (Debian's), the CNI bridge plugin on a bridge of
its own, and the kubelet built from Go modules at the control plane's pin (``tools/build.sh
kubelet``). The images it runs are the ones ``make images`` built (``tools/images.sh``), imported
into containerd's ``k8s.io`` namespace.

The node has no NVIDIA driver: the chart's device plugin describes its cards with the fake NVML
backend (``gpus.yaml`` here), and the sample workload image carries the stub driver libraries.
NVIDIA's container runtime is in the path all the same, containerd's default in CDI mode, with
the stub's cards as a CDI spec (``vgpu_sandbox.realruntime``).

Three host paths are fixed by Kubernetes and the product, so a machine holds one real node at a
time: ``/var/lib/kubelet/device-plugins`` (kubelet's registration socket, whatever its
``--root-dir``), ``/var/log/pods`` (container logs) and ``/var/lib/vgpu`` (the hook, grants and
regions). Whatever of them the sandbox created, it removes at ``down``.

One module per job; each imports only those above it in this list (a layers contract of
import-linter in pyproject.toml holds it):

- ``layout``: the node's name, taints, addresses, host paths and its folder's files
  (:class:`layout.NodeLayout`), the images ``make images`` built, the inventory's path;
- ``prechecks``: ``why_not``, why this machine cannot hold a real node, naming the fix;
- ``configs``: containerd's, the CNI's and the kubelet's configuration;
- ``values``: the generated Ansible inventory and the chart values the node needs;
- ``sample``: a pod of the sample image on the node (the demo's, the tests' and the bench's);
- ``daemons``: containerd's and the kubelet's command lines and readiness, ``ctr`` and ``crictl``;
- ``lifecycle``: ``start``, ``restart`` of containerd or the kubelet, and ``stop``.

The node's modes live beside it: ``vgpu_sandbox.realgpu`` (``--real-gpu``), ``realdra``
(``--dra``), ``realmps`` (``--sharing-mode mps``) and ``realruntime`` (NVIDIA's runtime).
"""
