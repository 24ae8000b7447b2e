"""The `pock` command line (pipelines/cli.py): help on every command, and bad cases and devices
refused with exit code 2 and a message naming what is allowed, before DVC runs."""
import pytest

from pipelines import cli

COMMANDS = [["compose"], ["status"], ["scheme", "show"], ["scheme", "search"], ["build"],
            ["bench"], ["report"], ["regress"], ["setup"], ["emulation", "setup"], ["pretuned"],
            ["device", "show"], ["gpu", "bundle"], ["gpu", "bench"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*command, "--help"])
    assert done.value.code == 0
    assert "usage: pock" in capsys.readouterr().out


@pytest.fixture
def configured(monkeypatch, params):
    """The CLI reads ``params`` (default: the default experiment) instead of params.yaml, and
    fails the test if it would start DVC."""
    def use(chosen=params):
        monkeypatch.setattr(cli, "_params", lambda: chosen)

    def no_dvc(targets):
        raise AssertionError(f"dvc repro {targets} ran on bad input")

    monkeypatch.setattr(cli, "_repro", no_dvc)
    use()
    return use


def test_unknown_device_lists_the_profiles(configured, capsys):
    assert cli.main(["build", "mbv2", "rpi9"]) == cli.EXIT_INPUT
    assert "'rpi9' has no profile; allowed: ['android_sd8g2'" in capsys.readouterr().err


def test_gpu_bench_refuses_an_unknown_peer_before_reading_the_bundle(tmp_path, capsys):
    code = cli.main(["gpu", "bench", str(tmp_path / "no-bundle"), str(tmp_path / "out.json"),
                     "--peers", "torch_eager_full,tflite"])
    assert code == cli.EXIT_INPUT
    assert "--peers: no peer ['tflite']; allowed: ['executorch_frozen'" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_unknown_case_lists_the_cases(configured, capsys):
    assert cli.main(["bench", "nope"]) == cli.EXIT_INPUT
    assert "no case 'nope'; cases: ['llama_full'" in capsys.readouterr().err


def test_device_not_configured_says_how_to_add_it(configured, params, capsys):
    # a device no case is built for: added to devices, the case to deploy
    configured(params.model_copy(update={"devices": [], "deploy": ["mbv2"]}))
    assert cli.main(["bench", "mbv2", "rpi4"]) == cli.EXIT_INPUT
    assert "pock compose 'devices=[rpi4]' 'deploy=[mbv2]'" in capsys.readouterr().err
    # a configured device, for a case not deployed: only the case is added
    configured(params)
    assert cli.main(["build", "mbv2_full", "rpi4"]) == cli.EXIT_INPUT
    assert (f"pock compose 'devices=[{','.join(params.devices)}]' 'deploy=[mbv2,mbv2_full]'"
            in capsys.readouterr().err)


def test_pretuned_without_a_tuning_run_says_what_to_run(capsys, monkeypatch, tmp_path):
    import pipelines.io

    monkeypatch.setattr(pipelines.io, "ARTIFACTS", tmp_path)
    assert cli.main(["pretuned", "host"]) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "no tuning database for 'host'" in err
    assert "the tune stages with the profile's tune.trials above 0" in err
