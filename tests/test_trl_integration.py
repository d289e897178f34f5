"""EBPOGRPOTrainer: real TRL training steps on CPU with the built-in tiny model.

Needs trl (CI tier `.ci/tier_integrations.sh`); skipped where it is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.trl
pytest.importorskip("trl")

from ebpo_lite.algo.advantages import EBPrior, ebpo_advantages  # noqa: E402
from ebpo_lite.algo.curriculum import make_sampler  # noqa: E402
from ebpo_lite.integrations import trl as ebpo_trl  # noqa: E402
from ebpo_lite.rewards import arithmetic_answer, combine_rewards  # noqa: E402

torch.set_num_threads(1)


def digit_share(completions, **kwargs):
    """A TRL-style reward with spread on an untrained model: the share of digit characters."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from ebpo_lite.model.tiny import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    build_tiny_model(0).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def _dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1), "level": i % 4} for i in range(n)]
    )


def _trainer(tiny_dir, out_dir, max_steps=2, cls=None, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        beta=0.0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    cls = cls or ebpo_trl.EBPOGRPOTrainer
    return cls(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        processing_class=AutoTokenizer.from_pretrained(tiny_dir),
        reward_funcs=[arithmetic_answer, digit_share],  # ours unchanged + a TRL-style one
        args=args,
        train_dataset=_dataset(),
        **kwargs,
    )


class Recording(ebpo_trl.EBPOGRPOTrainer):
    """Keeps what _generate_and_score_completions hands to the loss."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.recorded = getattr(self, "recorded", []) + [
            (out["advantages"].clone(), self.ebpo_last)
        ]
        return out


def test_two_steps_log_and_save_and_resume_the_prior(tiny_dir, tmp_path):
    tr = _trainer(tiny_dir, tmp_path, ebpo_options={"tau2": "moments"})
    tr.train()
    logged = [h for h in tr.state.log_history if "adv/shrinkage" in h]
    assert len(logged) == 2
    for key in ("adv/shrinkage", "adv/mu_glob", "adv/sigma2", "adv/tau2"):
        assert all(isinstance(h[key], float) for h in logged)
    assert 0.0 <= logged[-1]["adv/shrinkage"] <= 1.0
    saved = json.loads((tmp_path / "checkpoint-2" / ebpo_trl.PRIOR_FILE).read_text())
    assert saved == json.loads(json.dumps(tr.ebpo_prior.state_dict()))
    assert saved["step"] == 2 and saved["options"]["tau2"] == "moments"
    assert saved["global"]["mu"]["n"] == 4  # 2 steps x 2 prompts

    resumed = _trainer(tiny_dir, tmp_path, max_steps=3)  # default options: the state brings its own
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.ebpo_prior.step == 3  # 2 restored + 1 new, not 1
    assert resumed.ebpo_prior.options()["tau2"] == "moments"
    assert resumed.ebpo_prior.glob.acc["mu"].n == 6


def test_zero_shrinkage_gives_batch_whitened_dr_grpo(tiny_dir, tmp_path):
    # A prior whose tau2 is ~1e12 (constant groups at +-1e6, sigma2 = pooled within-group
    # variance) makes S = (sigma2 / G) / (sigma2 / G + tau2) ~ 1e-13.
    prior = EBPrior(sigma2="within")
    far = torch.tensor([[1e6] * 4, [-1e6] * 4] * 8)  # [16, 4]
    ebpo_advantages(far, prior)
    tr = _trainer(tiny_dir, tmp_path, cls=Recording, ebpo_prior=prior)
    tr.train()
    assert len(tr.recorded) == 2
    for used, last in tr.recorded:
        assert last["stats"]["shrinkage"] < 1e-9
        R = last["rewards"].double()  # [B, G]
        raw = R - R.mean(dim=1, keepdim=True)  # Dr. GRPO [B, G]
        white = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)  # [B, G]
        assert raw.abs().max() > 0.01  # the rewards do vary, so the check means something
        torch.testing.assert_close(used.double(), white.reshape(-1), rtol=1e-6, atol=1e-6)


def test_prompt_prior_and_leave_one_out_match_the_estimator(tiny_dir, tmp_path):
    opts = {"prompt_prior": True, "leave_one_out": True}
    tr = _trainer(tiny_dir, tmp_path, cls=Recording, ebpo_options=opts, max_steps=3)
    tr.train()
    replay = EBPrior(**opts)
    seen = []
    for used, last in tr.recorded:
        ids = last["prompts"]
        assert len(ids) == last["rewards"].shape[0] and all(isinstance(i, str) for i in ids)
        A, _ = ebpo_advantages(last["rewards"], replay, mask=last["mask"], prompts=ids)
        torch.testing.assert_close(A.reshape(-1).to(used.dtype), used, rtol=0, atol=0)
        seen += ids
    assert len(tr.ebpo_prior.prompts.rows) == len(set(seen))  # one history per distinct prompt
    assert tr.ebpo_prior.state_dict() == replay.state_dict()
    saved = json.loads((tmp_path / "checkpoint-3" / ebpo_trl.PRIOR_FILE).read_text())
    assert saved["prompts"]["tags"] == list(tr.ebpo_prior.prompts.rows)


def test_adaptive_curriculum_learns_and_resumes(tiny_dir, tmp_path):
    sampler = make_sampler("adaptive", 16, seed=3)
    tr = _trainer(tiny_dir, tmp_path, curriculum=sampler)
    assert tr.args.ignore_data_skip
    tr.train()
    assert sampler.trials.sum() == 2 * 2 * 4  # 2 steps x 2 prompts x G, seen once each
    state = json.loads((tmp_path / "checkpoint-2" / ebpo_trl.CURRICULUM_FILE).read_text())
    assert state["batches"] == 2  # the trained batches, not the prefetched ones
    assert sum(state["trials"]) == 16
    assert any(k.startswith("curriculum/") for k in tr.state.log_history[0])

    again = make_sampler("adaptive", 16, seed=3)
    resumed = _trainer(tiny_dir, tmp_path, max_steps=3, curriculum=again)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert again.trials.sum() == 24


def test_curriculum_sampler_keeps_repeat_sampler_layout():
    s = make_sampler("difficulty", 6, seed=0, difficulties=[0.9, 0.1, 0.5, 0.7, 0.3, 0.2])
    cs = ebpo_trl.CurriculumSampler(s, prompts_per_batch=2, mini_repeat_count=3, repeat_count=2)
    assert len(cs) == 3 * 2 * 3 * 2
    order = [0, 3, 2, 4, 5, 1]  # pass rate high (easy) to low
    expected = []
    for k in range(3):
        chunk = order[2 * k : 2 * k + 2]
        expected += [i for i in chunk for _ in range(3)] * 2
    assert list(cs) == expected
    assert [c for c, _ in cs.pending] == [[0, 3], [2, 4], [5, 1]]


def test_trl_style_reward_runs_in_ebpo_lite():
    def trl_style(prompts, completions, completion_ids, **kwargs):
        return [float(len(p) + len(c)) if c else None for p, c in zip(prompts, completions)]

    total, per_fn = combine_rewards(
        [ebpo_trl.trl_reward(trl_style)],
        None,
        ["12", "", "7"],
        prompts=["1+1=", "2+2=", "x"],
        answer=["2", "4", "7"],
    )
    assert total == [6.0, None, 2.0]
    assert list(per_fn) == ["trl_style"]


def test_version_outside_the_tested_range_is_refused(monkeypatch):
    ebpo_trl.check_trl_version("1.16.0")
    monkeypatch.delenv(ebpo_trl.SKIP_VERSION_ENV, raising=False)
    with pytest.raises(ImportError, match=r"trl 1\.15\.2 is installed"):
        ebpo_trl.check_trl_version("1.15.2")
    monkeypatch.setenv(ebpo_trl.SKIP_VERSION_ENV, "1")
    ebpo_trl.check_trl_version("2.0.0")


def test_import_ebpo_lite_does_not_import_trl():
    code = "import sys, ebpo_lite, ebpo_lite.algo.advantages; print('trl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, os.environ["TEST_DIR"])
    import test_trl_integration as t
    from pathlib import Path
    tiny, out = Path(sys.argv[1]), Path(sys.argv[2])
    tr = t._trainer(tiny, out, cls=t.Recording)
    tr.args.ddp_backend = "gloo"
    tr.train()
    rank = tr.accelerator.process_index
    used, last = tr.recorded[-1]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "prior": tr.ebpo_prior.state_dict(), "used": used.tolist(),
        "advantages": last["advantages"].reshape(-1).tolist()}))
    """
)


def test_two_processes_hold_the_same_prior(tiny_dir, tmp_path):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun not found")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {
        **os.environ,
        "TEST_DIR": str(Path(__file__).parent),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    t0 = time.perf_counter()
    run = subprocess.run(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            "--master_port",
            "29517",
            str(script),
            str(tiny_dir),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["prior"] == r1["prior"] and r0["prior"]["step"] == 2
    assert r0["prior"]["global"]["mu"]["n"] == 2 * 4  # 2 steps x (2 ranks x 2 prompts)
    assert r0["advantages"] == r1["advantages"]  # the whole generation batch, identical
    torch.testing.assert_close(
        torch.tensor(r0["used"] + r1["used"]), torch.tensor(r0["advantages"])
    )
    print(f"2-process run: {time.perf_counter() - t0:.1f}s")
