"""The goodput simulator: bookkeeping, limits with closed forms, ordering, calibration, CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from diloco_operator import simulator as sim
from diloco_operator.simulator import Assumptions, Scenario, simulate
from diloco_operator.simulator.model import split_slices, unsynced_seconds

HOUR = 3600.0


def test_no_failures_gives_full_goodput_and_uptime() -> None:
    a = Assumptions(chip_mtbi_hours=1e15)
    for scenario in (
        Scenario("non-elastic", 150_000),
        Scenario("elastic-dp", 150_000),
        Scenario("diloco", 150_000, 8),
    ):
        r = simulate(scenario, a, horizon_seconds=10 * HOUR)
        assert r.failures == 0
        assert r.goodput == pytest.approx(1.0)
        assert r.uptime == pytest.approx(1.0)


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario("non-elastic", 600_000),
        Scenario("elastic-dp", 600_000),
        Scenario("diloco", 600_000, 1),
        Scenario("diloco", 600_000, 4),
    ],
)
def test_every_chip_second_is_booked_once(scenario: Scenario) -> None:
    r = simulate(scenario, target_failures=2_000, seed=3)
    assert r.failures > 500  # paused groups accrue none, so fewer than the target
    assert r.accounted_fraction == pytest.approx(1.0, abs=1e-9)
    assert r.lost_work_chip_seconds > 0
    assert r.paused_chip_seconds > 0
    assert r.repair_chip_seconds > 0


def test_goodput_rises_with_chip_mtbi() -> None:
    for scenario in (Scenario("elastic-dp", 1_200_000), Scenario("diloco", 1_200_000, 8)):
        goodputs = [
            simulate(
                scenario, Assumptions(chip_mtbi_hours=y * 8760.0), target_failures=2_000
            ).goodput
            for y in (0.5, 1.0, 4.0)
        ]
        assert goodputs[0] < goodputs[1] < goodputs[2]


def test_more_learners_more_goodput_and_diloco_beats_elastic_dp() -> None:
    n = 1_200_000
    elastic = simulate(Scenario("elastic-dp", n), target_failures=3_000).goodput
    diloco = [simulate(Scenario("diloco", n, m), target_failures=3_000).goodput for m in (2, 4, 8)]
    assert elastic < diloco[0] < diloco[1] < diloco[2]
    non_elastic = simulate(Scenario("non-elastic", n), target_failures=3_000).goodput
    assert non_elastic < elastic


def test_repair_alone_matches_the_renewal_formula() -> None:
    # No pauses, no lost work: each slice alternates running (Exp, rate lam) and repair (fixed R),
    # so its availability is 1 / (1 + lam * R).
    a = Assumptions(reconfigure_seconds=0.0, step_seconds=1e-9, repair_hours=2.0)
    r = simulate(Scenario("diloco", 300_000, 4), a, target_failures=20_000, seed=1)
    expected = 1.0 / (1.0 + a.slice_failure_rate * a.repair_hours * HOUR)
    assert r.goodput == pytest.approx(expected, abs=0.003)
    assert r.uptime == pytest.approx(1.0)


def test_elastic_pause_matches_the_renewal_formula() -> None:
    # Repairs negligible: the whole job alternates running (Exp, rate Lam) and a fixed pause T.
    a = Assumptions(repair_hours=1e-6, step_seconds=1e-9, reconfigure_seconds=20.0)
    r = simulate(Scenario("elastic-dp", 1_200_000), a, target_failures=20_000, seed=2)
    fleet_rate = round(1_200_000 / a.slice_chips) * a.slice_failure_rate
    expected = 1.0 / (1.0 + fleet_rate * a.reconfigure_seconds)
    assert r.goodput == pytest.approx(expected, abs=0.01)
    assert r.uptime == pytest.approx(r.goodput, abs=1e-6)


def test_unsynced_work_follows_the_staggered_push_schedule() -> None:
    a = Assumptions(inner_steps=24, fragments=24, step_seconds=1.0)
    # Before the first push of any fragment, everything since the start is lost.
    assert unsynced_seconds(0.5, a) == pytest.approx(0.5)
    # After one full period each fragment was pushed at a different offset; averaged over the
    # learner's age the loss approaches H/2 steps.
    ages = [unsynced_seconds(100.0 + 0.01 * k, a) for k in range(2_400)]
    assert sum(ages) / len(ages) == pytest.approx(12.0, rel=0.05)
    assert max(ages) <= 24.0


def test_split_slices_is_balanced() -> None:
    assert split_slices(10, 3) == [4, 3, 3]
    assert sum(split_slices(4_687, 16)) == 4_687
    with pytest.raises(ValueError, match="groups need at least"):
        split_slices(2, 3)


def test_default_calibration_is_within_three_points_of_the_paper() -> None:
    cells = [Scenario(s, n, m) for (s, m, n) in sim.PAPER_GOODPUT]
    results = sim.sweep(cells, target_failures=4_000)
    deltas = sim.paper_deltas(results)
    assert len(deltas) == len(sim.PAPER_GOODPUT)
    worst = max(abs(d) for _, d in deltas)
    assert worst <= 0.03, [(r.scenario.label, r.scenario.total_chips, d) for r, d in deltas]


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="learners must be 1"):
        Scenario("elastic-dp", 1_000, 2)
    with pytest.raises(ValueError, match="total_chips"):
        Scenario("diloco", 0, 2)
    with pytest.raises(ValueError, match="slice_chips"):
        Assumptions(slice_chips=0)
    with pytest.raises(ValueError, match="repair_hours"):
        replace(Assumptions(), repair_hours=0.0)


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = sim.main(["--chips", "150000", "--learners", "1,4", "--failures", "300", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    labels = {(r["scenario"]["strategy"], r["scenario"]["learners"]) for r in rows}
    assert labels == {("non-elastic", 1), ("elastic-dp", 1), ("diloco", 1), ("diloco", 4)}
    assert all(0.0 < r["goodput"] <= 1.0 for r in rows)
    code = sim.main(["--chips", "150000", "--learners", "2", "--failures", "300"])
    assert code == 0
    assert "DiLoCo M=2" in capsys.readouterr().out


def test_cli_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--chips", "1000", "--slice-chips", "0"]) == 2
    assert "slice_chips" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main(["--chips", "abc"])


def test_markdown_table_puts_the_paper_beside_ours() -> None:
    results = sim.sweep(
        [Scenario("elastic-dp", 1_200_000), Scenario("diloco", 1_200_000, 8)], target_failures=500
    )
    table = sim.results_table_markdown(results)
    assert "paper 58%" in table and "paper 88%" in table
    assert table.count("\n") == 3  # header, separator, two rows


def test_diloco_cli_has_the_simulate_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from diloco_operator import cli

    code = cli.main(
        ["simulate", "--chips", "150000", "--learners", "2", "--failures", "200", "--json"]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["scenario"]["strategy"] for r in rows} == {"non-elastic", "elastic-dp", "diloco"}
