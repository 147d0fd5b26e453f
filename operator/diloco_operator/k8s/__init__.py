"""The operator on Kubernetes: kopf handlers, the objects they build, the cluster I/O."""
