"""The Kubernetes seam: the only floor that talks to the API server."""
