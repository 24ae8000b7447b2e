"""pipelines/stage.py: a compile phase's stage writes how long its process ran, once it has
succeeded; a stage that fails on bad input exits 2 and leaves the earlier time as it was."""
import json

import pytest

import pipelines.stage as stage
from pipelines.schema import ConfigError


def test_a_phase_writes_its_time_only_when_it_succeeds(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "phase_time_path",
                        lambda phase, name: tmp_path / phase / f"{name}.json")
    ran = []
    stage.run_stage(ran.append, "mbv2", phase="build")  # one argument: the case
    written = tmp_path / "build" / "mbv2.json"
    seconds = json.loads(written.read_text())["seconds"]
    assert ran == ["mbv2"] and 0 < seconds < 3600  # this process's age, imports included

    stage.run_stage(lambda case, device: None, "mbv2", "rpi4", phase="tune")
    assert (tmp_path / "tune" / "mbv2-rpi4.json").is_file()

    def bad(case):
        raise ConfigError("bad input")

    written.write_text('{"seconds": 1.5}')
    with pytest.raises(SystemExit) as stopped:
        stage.run_stage(bad, "mbv2", phase="build")
    assert stopped.value.code == stage.EXIT_INPUT
    assert json.loads(written.read_text()) == {"seconds": 1.5}

    stage.run_stage(ran.append, "mbv2")  # not a compile phase: nothing written
    assert sorted(p.name for p in tmp_path.rglob("*.json")) == ["mbv2-rpi4.json", "mbv2.json"]
