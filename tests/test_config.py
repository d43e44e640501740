"""CLI and YAML parsing, unknown keys, validate() rejections."""
import pytest

import config


def test_defaults_yaml_and_flags_layer(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("algo: grpo\ngroup_size: 4\nlr: 1e-4\nbatch_size: 16\n")
    cfg = config.parse(["--config", str(preset), "--lr", "0.5", "--no-norm-std"])
    assert (cfg.algo, cfg.group_size, cfg.lr, cfg.norm_std, cfg.gamma) == ("grpo", 4, 0.5, False, 0.99)
    assert config.parse(["--config", str(preset)]).lr == 1e-4  # YAML's "1e-4" string cast to float


def test_config_round_trips_through_the_run_dir(tmp_path):
    cfg = config.parse(["--algo", "ppo", "--epochs", "3"])
    config.save(cfg, tmp_path / "config.yaml")
    assert config.parse(["--config", str(tmp_path / "config.yaml")]) == cfg


@pytest.mark.parametrize("argv,needle", [
    (["--lrr", "3"], "did you mean '--lr'"),
    (["--algo", "grpo"], "--group-size 2"),
    (["--algo", "rloo", "--group-size", "1"], "--group-size 2"),
    (["--algo", "a2c"], "pick one of"),
    (["--eps", "0.3"], "--eps-high >= --eps"),
    (["--dual-clip", "0.5"], "> 1"),
    (["--loss-agg", "mean"], "token_mean"),
    (["--kl-estimator", "k4"], "k1, k2 or k3"),
    (["--batch-size", "6", "--group-size", "4", "--algo", "grpo"], "multiple of group_size"),
])
def test_rejections_name_the_fix(argv, needle):
    with pytest.raises(SystemExit, match="config error") as e:
        config.parse(argv)
    assert needle in str(e.value)


def test_unknown_yaml_key_names_the_closest(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("gama: 0.9\n")
    with pytest.raises(SystemExit, match="unknown key 'gama'.*did you mean 'gamma'"):
        config.parse(["--config", str(preset)])


def test_every_field_has_a_help_comment():
    helps = config._field_help()
    assert set(helps) == {f.name for f in config.dataclasses.fields(config.Config)}


def test_every_preset_parses():
    import glob
    presets = glob.glob("configs/*.yaml")
    assert len(presets) >= 10
    for path in presets:
        assert config.parse(["--config", path]).algo in config.ALGOS
