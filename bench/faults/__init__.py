"""Faults and what they cost: goodput (simulator, goodput_real), final loss under kills
(chaos_loss), syncer kills (syncer_failover), many random faults in one run (soak, with
soak_faults and soak_logs) and one misbehaving unit (bad_unit)."""
