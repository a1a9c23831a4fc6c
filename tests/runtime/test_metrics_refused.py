"""A metrics.jsonl write the system refuses (a full disk here, through /dev/full) is one warning: the run goes on,
the tracker still gets every record, nothing more is written to the file, and closing raises nothing."""

from __future__ import annotations

import json
import logging
import os

import pytest

from hybridtune.runtime.metrics import MetricsLog

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


class Tracker:
    def __init__(self):
        self.rows, self.closed = [], False

    def log(self, record):
        self.rows.append(record)

    def close(self):
        self.closed = True


def test_full_disk_is_one_warning_and_the_run_goes_on(tmp_path, caplog):
    tracker = Tracker()
    log = MetricsLog(tmp_path / "metrics.jsonl", truncate=True, tracker=tracker)
    log.write({"step": 1, "loss": 2.0})
    log.f.close()
    log.f = open("/dev/full", "w", encoding="utf-8")  # every flush: ENOSPC, as on a full disk
    with caplog.at_level(logging.WARNING, logger="hybridtune.runtime.metrics"):
        for step in (2, 3, 4):
            log.write({"step": step, "loss": 1.0})
        log.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "No space left on device (ENOSPC)" in warned[0] and "metrics.jsonl" in warned[0]
    assert [r["step"] for r in tracker.rows] == [1, 2, 3, 4] and tracker.closed
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.0}]
