"""The sweep's parallel runner (pipeline/seeds.py ``_run_parallel``): at most N runs at once, each one's output in
its own log, and a failure named with its log after the runs already started end."""

import json
import sys
import time

import pytest

from fledge.pipeline import seeds


def _fake_command(monkeypatch, tmp_path):
    """Each "run" records when it started and ended, sleeps, and exits with the code its overrides name."""
    def command(nproc, overrides):
        o = dict(x.split("=", 1) for x in overrides)
        code = (f"import json, time; t = time.time(); print('run {o['name']}'); time.sleep({o['sleep']}); "
                f"open({str(tmp_path / (o['name'] + '.json'))!r}, 'w').write(json.dumps([t, time.time()])); "
                f"raise SystemExit({o.get('exit', 0)})")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(seeds, "_command", command)


def _jobs(tmp_path, specs):
    out = []
    for name, sleep, *code in specs:
        (tmp_path / name).mkdir()
        out.append((name, tmp_path / name, [f"name={name}", f"sleep={sleep}"] + [f"exit={c}" for c in code]))
    return out


def test_runs_at_most_parallel_at_once_each_logging_to_its_own_file(tmp_path, monkeypatch):
    _fake_command(monkeypatch, tmp_path)
    jobs = _jobs(tmp_path, [("a", 1.5), ("b", 1.5), ("c", 0.1)])
    t0 = time.time()
    times = seeds._run_parallel(jobs, nproc=1, parallel=2)
    assert set(times) == {"a", "b", "c"}
    spans = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in "abc"}
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1]  # a and b overlapped
    assert spans["c"][0] >= min(spans["a"][1], spans["b"][1]) - 0.05  # c waited for a free slot
    assert time.time() - t0 < 4.5
    for n in "abc":
        assert (tmp_path / n / "sweep.log").read_text().startswith(f"run {n}")


def test_a_failed_run_ends_the_sweep_naming_its_log_once_the_started_runs_end(tmp_path, monkeypatch, capsys):
    _fake_command(monkeypatch, tmp_path)
    jobs = _jobs(tmp_path, [("ok", 1.0), ("bad", 0.1, 3), ("never", 0.1)])
    with pytest.raises(SystemExit) as e:
        seeds._run_parallel(jobs, nproc=1, parallel=2)
    assert e.value.code == 3
    assert (tmp_path / "ok.json").exists() and not (tmp_path / "never.json").exists()
    assert str(tmp_path / "bad" / "sweep.log") in capsys.readouterr().err
