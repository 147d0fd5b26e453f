"""Kubernetes operator and local runtime for elastic, decoupled DiLoCo runs."""
