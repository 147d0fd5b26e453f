"""Kubernetes: the operator on a real control plane (operator) and real pods on the e2e
cluster's real node (real_pods)."""
