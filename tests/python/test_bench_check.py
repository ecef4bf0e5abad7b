"""`scripts/bench --check`'s verdicts (scripts/bench.d/check.py), with its measurements replaced by
scripted ones: a row worse than its margin is measured again and is a regression only when the
second look is worse too; the exit code says whether any row regressed. The measurements
themselves are benchmarks (scripts/bench), not tests."""

import importlib.util
import json

import pytest

from conftest import REPO

ROW = "gang of 256 agents (× 256 single-node agents)"
STORE = "store GET 1 conn (× torch libuv; higher is better)"


@pytest.fixture
def check(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_check",
                                                  REPO / "scripts" / "bench.d" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"recorded": {"commit": "abc1234"}, "rows": {
        ROW: {"value": 1.30, "spread": 0.02, "rounds": []},
        STORE: {"value": 2.50, "spread": 0.05, "rounds": []},
    }}))
    monkeypatch.setattr(module, "BASELINE", baseline)
    monkeypatch.setattr(module, "RECORD", False)
    return module


def scripted(module, monkeypatch, looks):
    """Each call of measure() returns the next look: {row: median}; returns the groups asked."""
    asked = []
    groups = {ROW: "scale", STORE: "store"}

    def measure(groups_wanted=None):
        asked.append(groups_wanted)
        look = looks[len(asked) - 1]
        return ({row: [v] for row, v in look.items()}, {row: groups[row] for row in look})

    monkeypatch.setattr(module, "measure", measure)
    return asked


def test_a_row_worse_once_is_measured_again_and_passes(check, monkeypatch, capsys):
    asked = scripted(check, monkeypatch, [{ROW: 1.53, STORE: 2.45}, {ROW: 1.41}])
    assert check.main() == 0
    out = capsys.readouterr().out
    assert asked == [None, {"scale"}]
    assert "| 1.530, again 1.410 | ±0.130 | ok on a second look |" in out
    assert "no row regressed" in out


def test_a_row_worse_twice_is_a_regression(check, monkeypatch, capsys):
    asked = scripted(check, monkeypatch, [{ROW: 1.30, STORE: 1.60}, {STORE: 1.70}])
    assert check.main() == 1
    out = capsys.readouterr().out
    assert asked == [None, {"store"}]
    assert "| 1.600, again 1.700 | ±0.250 | REGRESSED |" in out
    assert f"| {ROW} | 1.300 | 1.300 | ±0.130 | ok |" in out
    assert "1 row(s) regressed" in out


def test_rows_within_their_margin_are_not_measured_again(check, monkeypatch, capsys):
    asked = scripted(check, monkeypatch, [{ROW: 1.05, STORE: 2.60}])
    assert check.main() == 0
    out = capsys.readouterr().out
    assert asked == [None]
    assert "better (record a new baseline)" in out
