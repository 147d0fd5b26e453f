"""Learner /metrics (a real learner against a real syncer on loopback), the syncer's tokens
counter, and the one log format of every program."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import subprocess
import sys
import threading
import urllib.request
from typing import Any

import pytest
from aiohttp import web
from diloco_trainer.auth import unit_token
from diloco_trainer.config import ModelConfig, TrainingConfig
from diloco_trainer.learner.metrics import (
    PEAK_FLOPS_ENV,
    LearnerMetrics,
    flops_per_token,
    param_count,
    peak_flops_per_device,
)
from diloco_trainer.logfmt import JsonFormatter, resolve_log_format
from diloco_trainer.models.gpt import param_shapes
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.http_api import build_app
from diloco_trainer.syncer.metrics import SyncerMetrics
from prometheus_client.parser import text_string_to_metric_families

TOKEN = "obs-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("preset", ["tiny", "small", "100m"])
def test_param_count_matches_the_model_shapes(preset: str) -> None:
    model = ModelConfig(preset=preset)
    assert param_count(model) == sum(math.prod(s) for s in param_shapes(model).values())
    expected = 6.0 * param_count(model) + 12.0 * model.depth * model.context * model.width
    assert flops_per_token(model) == expected


def test_peak_flops_from_the_table_or_the_environment() -> None:
    assert peak_flops_per_device("TPU v5 lite", {}) == 197e12
    assert peak_flops_per_device("TPU v4", {}) == 275e12
    assert peak_flops_per_device("cpu", {}) is None
    assert peak_flops_per_device("cpu", {PEAK_FLOPS_ENV: "2e12"}) == 2e12
    with pytest.raises(ValueError, match=PEAK_FLOPS_ENV):
        peak_flops_per_device("cpu", {PEAK_FLOPS_ENV: "fast"})
    with pytest.raises(ValueError, match=PEAK_FLOPS_ENV):
        peak_flops_per_device("cpu", {PEAK_FLOPS_ENV: "-1"})


def test_learner_counters_add_only_what_the_running_totals_grew() -> None:
    metrics = LearnerMetrics("u", "g", flops_per_token=100.0, peak_flops=1000.0)
    metrics.progress(2.5, 4.0, {"pushes": 3, "rejected": 1}, 100, 50, 0.25)
    metrics.progress(2.0, 5.0, {"pushes": 5, "rejected": 1, "push_failures": 2}, 160, 50, 0.2)
    labels = {"unit": "u", "group": "g"}
    value = metrics.registry.get_sample_value
    assert value("diloco_learner_pushes_total", {**labels, "result": "accepted"}) == 5
    assert value("diloco_learner_pushes_total", {**labels, "result": "rejected"}) == 1
    assert value("diloco_learner_pushes_total", {**labels, "result": "failed"}) == 2
    assert value("diloco_learner_bytes_sent_total", labels) == 160
    assert value("diloco_learner_loss", labels) == 2.0
    assert value("diloco_learner_mfu_ratio", labels) == 5.0 * 100.0 / 1000.0
    assert value("diloco_learner_overwritten_ratio", labels) == 0.2  # the last log's share


def test_syncer_tokens_is_a_counter_from_what_the_process_restored() -> None:
    metrics = SyncerMetrics()
    metrics.count_tokens(5000)  # restored from a checkpoint: the baseline, not a jump
    metrics.count_tokens(5600)
    metrics.count_tokens(5400)  # never backwards
    metrics.count_tokens(6000)
    assert metrics.registry.get_sample_value("diloco_syncer_tokens_total") == 1000
    assert metrics.registry.get_sample_value("diloco_syncer_tokens") is None


class Served:
    """A Syncer on a loopback port, served from a background event loop."""

    def __init__(self, cfg: TrainingConfig) -> None:
        self.syncer = Syncer(cfg, TOKEN, run="obs", store=None, eval_fn=None)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = web.AppRunner(build_app(self.syncer))
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return int(self.runner.addresses[0][1])

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.syncer.close()


def test_a_learner_serves_its_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco_trainer.learner.loop import run_learner
    from diloco_trainer.learner.options import LearnerOptions

    cfg = TrainingConfig.model_validate(
        {
            "model": {"preset": "tiny", "dModel": 16, "nLayers": 1, "nHeads": 2, "seqLen": 8},
            "data": {"batchSize": 2},
            "fragments": 2,
            "innerSteps": 4,
            "totalSteps": 10_000,
            "heartbeatSeconds": 0.1,
            "eval": {"everySeconds": None},
        }
    )
    monkeypatch.setenv(PEAK_FLOPS_ENV, "1e9")  # CPU has no table entry: MFU against this peak
    server = Served(cfg)
    port = free_port()
    try:
        opts = LearnerOptions(
            syncer=f"http://127.0.0.1:{server.port}",
            token=unit_token(TOKEN, "obs-default-0"),
            unit=0,
            num_units=1,
            unit_name="obs-default-0",
            log_every=4,
            max_steps=16,
            metrics_port=port,
        )
        result = run_learner(cfg, opts)
    finally:
        server.close()
    got = scrape(port)
    unit = (("group", "default"), ("unit", "obs-default-0"))
    assert got[("diloco_learner_steps_total", unit)] == result.steps == 16
    assert got[("diloco_learner_tokens_total", unit)] == 16 * cfg.tokens_per_step
    assert got[("diloco_learner_step_seconds_count", unit)] == 15  # the compiling step left out
    assert got[("diloco_learner_bytes_received_total", unit)] > 0
    accepted = (("group", "default"), ("result", "accepted"), ("unit", "obs-default-0"))
    assert got[("diloco_learner_pushes_total", accepted)] >= 1
    assert got[("diloco_learner_tokens_per_second", unit)] > 0
    mfu = got[("diloco_learner_mfu_ratio", unit)]
    tps = got[("diloco_learner_tokens_per_second", unit)]
    assert mfu == pytest.approx(tps * flops_per_token(cfg.model) / 1e9)
    assert math.isfinite(got[("diloco_learner_loss", unit)])
    assert 0.0 <= got[("diloco_learner_overwritten_ratio", unit)] <= 1.0


def test_json_lines_carry_what_cloud_logging_reads() -> None:
    record = logging.LogRecord("diloco.syncer", logging.WARNING, __file__, 1, "x=%d", (3,), None)
    line = json.loads(JsonFormatter().format(record))
    assert line["severity"] == "WARNING" and line["message"] == "x=3"
    assert line["logger"] == "diloco.syncer" and line["time"].endswith("+00:00")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord("l", logging.ERROR, __file__, 1, "bad", (), sys.exc_info())
    text = json.loads(JsonFormatter().format(failed))["message"]
    assert text.startswith("bad\n") and "RuntimeError: boom" in text


def test_log_format_flag_beats_the_environment_and_bad_values_name_their_source() -> None:
    assert resolve_log_format(None, {}) == "text"
    assert resolve_log_format(None, {"DILOCO_LOG_FORMAT": "JSON"}) == "json"
    assert resolve_log_format("text", {"DILOCO_LOG_FORMAT": "json"}) == "text"
    with pytest.raises(ValueError, match="DILOCO_LOG_FORMAT: must be one of text, json"):
        resolve_log_format(None, {"DILOCO_LOG_FORMAT": "yaml"})


def test_a_program_configured_for_json_writes_json_lines() -> None:
    code = (
        "import logging; from diloco_trainer.logfmt import configure_logging; "
        "configure_logging('INFO', 'json'); logging.getLogger('diloco.test').info('event=hi n=%d', 1)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    entries: list[dict[str, Any]] = [json.loads(line) for line in out.stderr.splitlines()]
    assert len(entries) == 1
    assert {"severity": "INFO", "message": "event=hi n=1", "logger": "diloco.test"}.items() <= (
        entries[0].items()
    )


@pytest.mark.parametrize("program", ["learner", "syncer"])
def test_programs_refuse_an_unknown_log_format(
    program: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DILOCO_LOG_FORMAT", "xml")
    if program == "learner":
        from diloco_trainer.learner import main as learner_main

        code = learner_main.main(["--config", "unused.yaml"])
    else:
        from diloco_trainer.syncer import main as syncer_main

        code = syncer_main.main(["--config", "unused.yaml"])
    assert code == 2
    assert "DILOCO_LOG_FORMAT: must be one of text, json, got 'xml'" in capsys.readouterr().err
