"""The `pock` command line: help on every command, and bad devices refused before DVC runs."""
import pytest

from pipelines import cli

COMMANDS = [["compose"], ["status"], ["scheme", "show"], ["scheme", "search"], ["build"],
            ["bench"], ["report"], ["regress"], ["setup"], ["emulation", "setup"], ["pretuned"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*command, "--help"])
    assert done.value.code == 0
    assert "usage: pock" in capsys.readouterr().out


def test_unknown_device_lists_the_profiles(capsys):
    assert cli.main(["build", "rpi9"]) == cli.EXIT_INPUT
    assert "'rpi9' has no profile; allowed: ['android_sd8g2'" in capsys.readouterr().err


def test_device_not_configured_says_how_to_add_it(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_configured_devices", lambda: ["other"])
    assert cli.main(["bench", "host"]) == cli.EXIT_INPUT
    assert "pock compose 'devices=[other,host]'" in capsys.readouterr().err


def test_pretuned_without_a_tuning_run_says_what_to_run(capsys, monkeypatch, tmp_path):
    import pipelines.artifacts

    monkeypatch.setattr(pipelines.artifacts, "ARTIFACTS", tmp_path)
    assert cli.main(["pretuned", "host"]) == cli.EXIT_INPUT
    assert "run `dvc repro tune@host` with the profile's tune.trials above 0" in \
        capsys.readouterr().err
