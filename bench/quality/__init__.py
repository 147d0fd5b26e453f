"""Loss at equal tokens: decoupled DiLoCo against data-parallel and synchronous DiLoCo (parity,
parity_chaos, parity_trend), what an install keeps (install), and what each part is worth under a
controlled clock (ablations)."""
