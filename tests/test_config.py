"""Config parsing and user errors: one line naming the key, file or file:line; exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ebpo_lite import config
from ebpo_lite.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny_cpu.yaml"


def test_recipe_loads_with_overrides():
    cfg = config.load(
        TINY,
        [
            "train.steps=20",
            "train.seed=1",
            "output_dir=runs/x",
            "rollout.backend=hf",
            "algo.estimator=grpo",
            "train.lr=1e-5",
        ],
    )
    assert cfg.train.steps == 20 and cfg.train.seed == 1 and cfg.output_dir == "runs/x"
    assert cfg.algo.estimator == "grpo"
    assert cfg.train.lr == pytest.approx(1e-5)  # YAML 1.1 reads 1e-5 as a string: accepted
    assert cfg.model.trainable_extra == ["norm"]
    recipe_steps = yaml.safe_load(TINY.read_text())["train"]["steps"]
    assert config.load(TINY).train.steps == recipe_steps != 20  # overrides do not leak


def test_yaml_string_float_in_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lr: 1e-5\nalgo:\n  decay: 0.99\n  prior_key: topic\n")
    cfg = config.load(p)
    assert cfg.train.lr == pytest.approx(1e-5) and cfg.algo.decay == 0.99
    assert cfg.algo.prior_key == "topic"


def test_dump_round_trips(tmp_path):
    cfg = config.load(TINY, ["algo.decay=0.9", "curriculum.topic_order=[mul,add]"])
    p = tmp_path / "c.yaml"
    p.write_text(config.dump(cfg))
    assert config.load(p) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.steps=-1", "train.steps: must be >= 1"),
        ("train.lr=-0.1", "train.lr: must be > 0"),
        ("train.lr=abc", "train.lr: expected a float"),
        ("rollout.group_size=1", "rollout.group_size: must be >= 2"),
        ("algo.estimator=ppo", "algo.estimator: expected one of"),
        ("train.stepz=3", "train.stepz: unknown key"),
        ("trainer.steps=3", "trainer: unknown section"),
        ("train.steps=2.5", "train.steps: expected an integer"),
        ("model.load_in_4bit=maybe", "model.load_in_4bit: expected true or false"),
        ("algo.decay=1.5", "algo.decay: must be in (0, 1)"),
        ("reward.weights=[1,2]", "reward.weights: expected 1 weights"),
        ("curriculum.sampler=random", "curriculum.sampler: expected one of"),
        ("train", "overrides are written key=value"),
        ("eval.benchmarks=[math501]", "eval.benchmarks: expected one of"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        config.load(TINY, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: not valid YAML"):
        config.load(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        config.load(top)


def _cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "ebpo_lite.train", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["missing.yaml"], "missing.yaml: recipe file not found"),
        ([TINY, "train.steps=-1"], "train.steps"),
        ([TINY, "rollout.group_size=1"], "rollout.group_size"),
        ([TINY, "algo.estimator=nope"], "algo.estimator"),
        ([TINY, "bogus.key=1"], "bogus: unknown section"),
        ([TINY, "output_dir=/proc/forbidden/run"], "output_dir: cannot write"),
        ([TINY, "data.path=/nonexistent/file.jsonl"], "/nonexistent/file.jsonl"),
    ],
)
def test_user_errors_exit_2_with_one_line(args, needle, capsys, monkeypatch, tmp_path):
    from ebpo_lite.train import main

    monkeypatch.chdir(REPO)
    if "output_dir=/proc" not in str(args):
        args = [*args, f"output_dir={tmp_path / 'run'}"]
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0]


def test_cli_process_exit_status_and_no_traceback():
    r = _cli(TINY, "train.steps=-1")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: train.steps: must be >= 1, got -1"


def test_cli_help(capsys):
    from ebpo_lite.train import main

    assert main(["--help"]) == 0 and "usage" in capsys.readouterr().out
    assert main([]) == 2  # no recipe: usage, and a failing status


def test_rollout_sleep_takes_its_three_modes_and_refuses_others_in_one_line():
    for mode in ("offload", "kv", "none"):
        assert config.load(None, [f"rollout.sleep={mode}"]).rollout.sleep == mode
    assert config.Config().rollout.sleep == "offload"
    with pytest.raises(ConfigError) as e:
        config.load(None, ["rollout.sleep=ofload"])
    msg = str(e.value)
    assert msg.startswith("rollout.sleep: expected one of offload, kv, none") and "\n" not in msg
    assert "did you mean offload?" in msg
    with pytest.raises(ConfigError, match=r"^rollout\.sleep: expected a string, got True"):
        config.load(None, ["rollout.sleep=true"])


def test_deprecated_sleep_between_phases_reads_as_rollout_sleep(capsys):
    """An older run's config.yaml (eval reads it back) keeps loading: true is offload, false
    none, with a one-line note; a non-bool, or a different rollout.sleep beside it, is refused
    in one line naming the old key; a dump writes only rollout.sleep."""
    on = config.load(None, ["rollout.sleep_between_phases=true"])
    assert on.rollout.sleep == "offload" and not hasattr(on.rollout, "sleep_between_phases")
    off = config.load(None, ["rollout.sleep_between_phases=false", "rollout.sleep=none"])
    assert off.rollout.sleep == "none"
    err = capsys.readouterr().err
    assert err.count("note: rollout.sleep_between_phases is deprecated") == 2
    assert "read as rollout.sleep=none" in err
    for bad in (["rollout.sleep_between_phases=false", "rollout.sleep=kv"],
                ["rollout.sleep_between_phases=1"]):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            config.load(None, bad)
        msg = str(e.value)
        assert msg.startswith("rollout.sleep_between_phases: deprecated (true: rollout.sleep=")
        assert "\n" not in msg
    dumped = yaml.safe_load(config.dump(on))["rollout"]
    assert dumped["sleep"] == "offload" and "sleep_between_phases" not in dumped
