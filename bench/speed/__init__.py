"""Throughput and memory: the learner against a bare train loop (overhead), the model entrypoint
path (entrypoint), the syncer's merge (syncer), FSDP inside a unit (sharding), one GPU (gpu, run
through gpu.sh) and units of different speeds (mixed_speed)."""
