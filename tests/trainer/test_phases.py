"""Start-up phases as log lines (diloco_trainer/phases.py): what `phase` writes, in both log
formats, and what `read_phase_line` makes of it."""

from __future__ import annotations

import logging

import pytest
from diloco_trainer.logfmt import TEXT_FORMAT, JsonFormatter
from diloco_trainer.phases import PhaseLine, phase, read_phase_line


def _lines(caplog: pytest.LogCaptureFixture, formatter: logging.Formatter) -> list[str]:
    return [formatter.format(record) for record in caplog.records]


def test_a_phase_logs_its_start_before_the_work_and_its_seconds_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.phases")
    caplog.set_level(logging.INFO, logger="test.phases")
    with phase(log, "data_index", unit="u-0"):
        assert [r.getMessage() for r in caplog.records] == [
            "event=phase_started phase=data_index unit=u-0"
        ]
    done = caplog.records[-1].getMessage()
    assert done.startswith("event=phase_done phase=data_index seconds=")
    assert read_phase_line(done) == PhaseLine("done", "data_index", float(done.split("=")[-1]))


def test_a_failing_phase_says_so_and_the_error_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.phases")
    caplog.set_level(logging.INFO, logger="test.phases")
    with pytest.raises(OSError, match="bucket"), phase(log, "restore"):
        raise OSError("bucket not found")
    failed = caplog.records[-1]
    assert failed.levelno == logging.WARNING
    assert failed.getMessage().startswith("event=phase_failed phase=restore seconds=")
    assert failed.getMessage().endswith(" error=OSError")
    parsed = read_phase_line(failed.getMessage())
    assert parsed is not None and parsed.event == "failed" and parsed.name == "restore"


def test_nested_phases_close_innermost_first(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.phases")
    caplog.set_level(logging.INFO, logger="test.phases")
    with phase(log, "workload_check"), phase(log, "model_build"):
        pass
    got = [read_phase_line(r.getMessage()) for r in caplog.records]
    assert [(p.event, p.name) for p in got if p is not None] == [
        ("started", "workload_check"),
        ("started", "model_build"),
        ("done", "model_build"),
        ("done", "workload_check"),
    ]


@pytest.mark.parametrize("name", ["Data index", "data index", "", "9lives", "data-index"])
def test_a_phase_name_is_one_lower_case_word(name: str) -> None:
    with pytest.raises(ValueError, match="phase name"), phase(logging.getLogger("t"), name):
        pass


@pytest.mark.parametrize("formatter", [logging.Formatter(TEXT_FORMAT), JsonFormatter()])
def test_lines_of_either_log_format_are_read_back(
    caplog: pytest.LogCaptureFixture, formatter: logging.Formatter
) -> None:
    log = logging.getLogger("test.phases")
    with caplog.at_level(logging.INFO, logger="test.phases"), phase(log, "compile"):
        pass
    started, done = (read_phase_line(line) for line in _lines(caplog, formatter))
    assert started == PhaseLine("started", "compile")
    assert done is not None and done.event == "done" and done.seconds is not None


@pytest.mark.parametrize(
    "line",
    [
        "2026-12-05 10:00:00,000 level=INFO logger=x event=listening port=1",
        "event=phase_started",  # no phase
        "event=phase_begun phase=compile",
        "event=UnitOnline message='event=phase_started phase=compile'",  # quoted, not adjacent
        '{"message": 3}',
        "{not json event=phase_started",
    ],
)
def test_other_lines_are_not_phase_lines(line: str) -> None:
    assert read_phase_line(line) is None
