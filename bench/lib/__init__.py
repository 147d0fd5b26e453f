"""What several sections share: the report's plumbing (`common`), plots, the real syncer and
local runs (`live`), syncer log lines, the parity model's training runs (`training`) and the
controlled-clock model of decoupled DiLoCo (`decoupled_model`)."""
