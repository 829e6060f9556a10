"""Kubelet device plugin API v1beta1: api.proto and the stubs `make proto` generates from it."""
