"""Goodput simulator: a discrete-event model of training on a fleet of failing chips (`model`),
the presentation of its results (`report`) and the `diloco simulate` command (`cli`)."""

from diloco_operator.simulator.cli import add_arguments, main, run_from_args
from diloco_operator.simulator.model import (
    PAPER_GOODPUT,
    Assumptions,
    Scenario,
    SimResult,
    default_scenarios,
    simulate,
    sweep,
)
from diloco_operator.simulator.report import (
    describe_assumptions,
    paper_deltas,
    plot_goodput,
    results_table_markdown,
)

__all__ = [
    "PAPER_GOODPUT",
    "Assumptions",
    "Scenario",
    "SimResult",
    "add_arguments",
    "default_scenarios",
    "describe_assumptions",
    "main",
    "paper_deltas",
    "plot_goodput",
    "results_table_markdown",
    "run_from_args",
    "simulate",
    "sweep",
]
