"""The ``xdist_group`` names that keep tests which share something on one worker at a time
(tests/README.md, "Parallel runs"). ``make test`` runs ``pytest -n 2 --dist loadgroup``: tests of
one group run on one worker, one after the other; tests/conftest.py gives every test a group."""

from __future__ import annotations

# The real node: one per machine (/var/lib/kubelet, /var/log/pods, /var/lib/vgpu, the bridge
# vgpu-sbx0, containerd's images). A module that starts it, or reads or writes what it uses, says
# ``pytestmark = pytest.mark.xdist_group(REAL_NODE)``; tests/unit/test_test_groups.py checks that.
REAL_NODE = "realnode"
# Every module with a test that uses the session's sandbox (tests/e2e/conftest.py): one sandbox
# per run rather than one per worker, which two cores would not carry beside the other tests.
SANDBOX = "sandbox"
