"""Launchers start, find and stop worker pools: local processes or Kubernetes."""
