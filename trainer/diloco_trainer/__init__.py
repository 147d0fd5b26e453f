"""JAX trainer for decoupled DiLoCo: learners (inner loop) and the syncer (outer loop)."""
