"""The pure core: requests, fit, ledger, policy, annotations, errors, settings.

Imports no Kubernetes, Flask, gRPC or sandbox (checked by import-linter in make lint).
"""
