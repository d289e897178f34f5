"""The vLLM / Unsloth backends' pure helpers and error paths: default tier, no vllm needed."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from ebpo_lite import config
from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.rollout import common as rv


@pytest.mark.parametrize(
    "rank,expected",
    [
        (1, 1),
        (2, 8),
        (4, 8),
        (8, 8),
        (9, 16),
        (16, 16),
        (33, 64),
        (257, 320),
        (321, 512),
        (512, 512),
    ],
)
def test_lora_rank_rounds_up_to_a_size_vllm_accepts(rank, expected):
    assert rv.round_lora_rank(rank) == expected


def test_lora_rank_above_512_names_the_key():
    with pytest.raises(ConfigError, match=r"^model\.lora_rank: LoRA rank 513 is above 512"):
        rv.round_lora_rank(513, "model.lora_rank")


def test_max_model_len_is_prompt_plus_completion_capped_by_the_model():
    assert rv.derive_max_model_len(1024, 8, None) == 1032
    assert rv.derive_max_model_len(1024, 8, 512) == 512  # the tiny model's 512 positions
    assert rv.derive_max_model_len(100, 28, 512) == 128
    assert rv.derive_max_model_len(1024, 8, 512, explicit=300) == 300
    with pytest.raises(ConfigError, match=r"^rollout\.max_model_len: 600 is above"):
        rv.derive_max_model_len(1024, 8, 512, explicit=600)


def test_prompt_that_does_not_fit_is_a_user_error_naming_the_key():
    rv.check_lengths([[1] * 120, [2] * 3], 8, 128)  # exactly fits
    with pytest.raises(UserError, match=r"^rollout\.max_model_len: a prompt of 121 tokens \+ 8"):
        rv.check_lengths([[1] * 121], 8, 128)


def test_request_seeds_are_deterministic_and_distinct_per_prompt():
    a = rv.request_seeds(7, 64, 8)
    assert a == rv.request_seeds(7, 64, 8)
    assert rv.request_seeds(8, 64, 8) != a
    assert rv.request_seeds(7, 3, 8) == a[:3]  # prompt i's seed does not depend on the batch size
    assert all(0 <= s < 2**32 + 64 * 8 for s in a)


# a step seed whose former per-prompt seeds (one independent 32-bit hash per prompt) came 2 apart
# at B = 1024: sample 2 of one prompt and sample 0 of another got the same vLLM seed
OVERLAPPED_BEFORE = 323


@pytest.mark.parametrize("step_seed", [7, OVERLAPPED_BEFORE])
def test_no_two_sequences_of_a_call_share_a_vllm_seed(step_seed):
    """vLLM seeds sample g of a request seeded s with s + g (v1/engine/parallel_sampling.py), and
    equal seeds draw equal noise: every one of the B * G sequences must get its own seed."""
    B, G = 1024, 8
    seeds = [s + g for s in rv.request_seeds(step_seed, B, G) for g in range(G)]
    assert len(set(seeds)) == B * G


@pytest.mark.parametrize(
    "top_p,top_k,min_p,mode,warns",
    [
        (1.0, 0, 0.0, "token", False),
        (0.9, 0, 0.0, "token", True),
        (1.0, 20, 0.0, "sequence", True),
        (1.0, 0, 0.05, "token", True),
        (0.9, 20, 0.05, "none", True),
        (1.0, 0, 0.0, "none", False),
    ],
)
def test_truncation_warning_whenever_sampling_is_truncated(top_p, top_k, min_p, mode, warns):
    msg = rv.truncation_warning(top_p, top_k, min_p, mode)
    assert (msg is not None) == warns
    if warns:
        assert "rollout/logp_diff_" in msg
        assert ("algo.is_correction" in msg) == (mode != "none")


def test_truncation_warning_is_issued_once(monkeypatch):
    monkeypatch.setattr(rv, "_warned_truncation", False)
    cfg = config.load(None, ["rollout.top_p=0.9", "algo.is_correction=token"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rv.maybe_warn_truncation(cfg.rollout, cfg.algo)
        rv.maybe_warn_truncation(cfg.rollout, cfg.algo)
    assert len([w for w in caught if "rollout.top_p=0.9" in str(w.message)]) == 1


def test_visible_device_maps_the_parent_index_to_one_physical_gpu():
    assert rv.visible_device_for(1, None) == "1"
    assert rv.visible_device_for(1, "4,6") == "6"
    assert rv.visible_device_for(0, " 3 , 5") == "3"
    with pytest.raises(ConfigError, match=r"^rollout\.device: cuda:2"):
        rv.visible_device_for(2, "4,6")


def test_adapter_root_is_writable():
    root = rv.adapter_root()
    assert root.is_dir() and os.access(root, os.W_OK)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert str(root) == "/dev/shm"


FLAGSHIP_EXCHANGE = 2 * 350 * 10**6  # two versions of the flagship's fp32 adapter (~350 MB)


@pytest.mark.parametrize(
    "free_mib,need,on_shm",
    [
        (64, FLAGSHIP_EXCHANGE, False),  # Docker's default /dev/shm: the temp dir
        (700, FLAGSHIP_EXCHANGE, False),  # room for one version only, not for the headroom
        (800, FLAGSHIP_EXCHANGE, True),
        (64, 2 * 10**6, False),  # even a tiny adapter: 64 MiB is all headroom
        (100, 2 * 10**6, True),
    ],
)
def test_adapter_root_is_dev_shm_only_with_room(monkeypatch, free_mib, need, on_shm):
    """The free space is faked (a full /dev/shm cannot be made here); the rule is real."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no writable /dev/shm")
    monkeypatch.setattr(rv, "_free_bytes", lambda path: free_mib * 2**20)
    root = rv.adapter_root(need)
    assert root == (rv.SHM if on_shm else Path(tempfile.gettempdir()))
    lines = []
    workdir = rv.adapter_workdir("test", need, lines.append)
    try:
        assert workdir.parent == root and workdir.name.startswith(f"ebpo_lite_test_{os.getpid()}_")
        assert bool(lines) != on_shm  # the fallback is said, with the fix
        assert not lines or "docker run --shm-size" in lines[0]
    finally:
        workdir.rmdir()


def test_exchange_bytes_counts_two_adapter_versions_and_a_trained_base(tmp_path):
    """From the policy's own parameters (the tiny model with LoRA, fp32)."""
    from transformers import AutoModelForCausalLM

    from ebpo_lite.model.policy import Policy, _add_lora
    from ebpo_lite.model.tiny import save_random_qwen3

    model = AutoModelForCausalLM.from_pretrained(save_random_qwen3(tmp_path / "base"))
    m = config.load(None, ["model.trainable_extra=[norm]"]).model
    model = _add_lora(model, m)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    policy = Policy(model, None, torch.device("cpu"), "base", 16, [], torch.float32)
    assert rv.exchange_bytes(policy) == 2 * 4 * lora  # the base stays out of it
    policy.trainable_extra = ["norm"]  # then the base is exported (and reloaded) each sync too
    assert rv.exchange_bytes(policy) == 2 * 4 * lora + 4 * base


def test_exchange_bytes_counts_an_nf4_weight_at_its_16_bit_size_on_disk():
    pytest.importorskip("bitsandbytes")
    from types import SimpleNamespace as NS

    from ebpo_lite.commands.qlora_check import nf4_layer

    layer = nf4_layer(torch.randn(64, 128), torch.float32, torch.device("cpu"))
    assert layer.weight.numel() == 64 * 128 // 2  # two 4-bit codes per stored byte
    assert rv.exchange_bytes(NS(model=layer, trains_base=True)) == 64 * 128 * 2


def test_adapter_workdir_removes_folders_of_dead_processes_only(tmp_path, monkeypatch):
    """A killed run leaves its folders in /dev/shm (memory) until reboot: the next run removes
    them; a live process's (this one's) and folders of another naming stay."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    monkeypatch.setattr(rv, "SHM", tmp_path)  # the root under test, instead of the real /dev/shm
    monkeypatch.setattr(rv, "_free_bytes", lambda path: 2**40)
    gone = tmp_path / f"ebpo_lite_vllm_{dead}_abc"
    kept = [tmp_path / f"ebpo_lite_vllm_{os.getpid()}_abc", tmp_path / "ebpo_lite_vllm_r3sc60q_"]
    for d in (gone, *kept):
        (d / "adapter-v3").mkdir(parents=True)
    new = rv.adapter_workdir("vllm", 0)
    assert not gone.exists() and all(d.is_dir() for d in kept) and new.parent == tmp_path


@pytest.mark.parametrize(
    "engine,trainer,visible,expected",
    [
        (0, 0, None, {}),  # the default single-GPU layout: in process
        (None, None, None, {}),  # "cuda" with no index is cuda:0
        (1, 0, None, "1"),  # the two-GPU layout
        (1, 1, None, "1"),  # colocated on cuda:1: in process, vLLM's worker would take cuda:0
        (3, 3, "4,5,6,7", "7"),
        (0, 1, None, "0"),  # in process, the worker would make cuda:0 the trainer's current GPU
    ],
)
def test_an_engine_off_cuda_0_gets_its_own_process_on_its_gpu(engine, trainer, visible, expected):
    env = rv.engine_process_env(engine, trainer, visible)
    if expected == {}:
        assert env == {}
    else:
        assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "CUDA_VISIBLE_DEVICES": expected}


def test_vllm_backend_on_cuda_n_starts_its_engine_in_its_own_process(monkeypatch):
    """`VLLMRollout._engine_env` with both sides on cuda:1 (devices faked: no GPU here; the method
    reads only these attributes)."""
    from types import SimpleNamespace as NS

    from ebpo_lite.rollout.vllm import VLLMRollout

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    cfg = config.load(None, ["train.threads=1"])
    one = torch.device("cuda", 1)
    fake = NS(cfg=cfg, on_gpu=True, device=one, policy=NS(device=one))
    env = VLLMRollout._engine_env(fake)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "3"
    zero = torch.device("cuda", 0)
    env = VLLMRollout._engine_env(NS(cfg=cfg, on_gpu=True, device=zero, policy=NS(device=zero)))
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "CUDA_VISIBLE_DEVICES" not in env


def test_preserved_rng_restores_python_numpy_and_torch_streams():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with rv.preserved_rng():
        random.seed(99)  # what vLLM's in-process engine does at start-up
        np.random.seed(99)
        torch.manual_seed(99)
        torch.rand(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_sampling_params_carry_the_rollout_settings():
    class Recorder(dict):
        def __init__(self, **kw):
            super().__init__(kw)

    r = config.load(
        None,
        ["rollout.top_k=0", "rollout.top_p=0.95", "rollout.min_p=0.1", "rollout.temperature=0.7"],
    ).rollout
    params = rv.sampling_params(
        Recorder,
        r,
        group_size=4,
        seed=5,
        num_prompts=3,
        temperature=None,
        max_tokens=12,
        stop_ids=(1, 7),
    )
    assert len(params) == 3
    assert [p["seed"] for p in params] == rv.request_seeds(5, 3, 4)
    p = params[0]
    assert (p["n"], p["temperature"], p["top_p"], p["top_k"], p["min_p"], p["max_tokens"]) == (
        4,
        0.7,
        0.95,
        -1,
        0.1,
        12,
    )  # top_k 0 (off) is vLLM's -1
    assert p["logprobs"] == 0 and p["stop_token_ids"] == [1, 7]  # every end-of-turn id
    greedy = rv.sampling_params(Recorder, r, 1, 0, 1, temperature=0.0, max_tokens=3, stop_ids=())
    assert greedy[0]["temperature"] == 0.0 and greedy[0]["stop_token_ids"] is None


def test_outputs_to_rollout_is_prompt_major_and_sorted_by_sample_index():
    from types import SimpleNamespace as NS

    def lp(ids, vals):
        return [{t: NS(logprob=v)} for t, v in zip(ids, vals)]

    outs = [
        NS(
            outputs=[
                NS(
                    index=1,
                    token_ids=[5, 1],
                    logprobs=lp([5, 1], [-0.5, -0.1]),
                    finish_reason="stop",
                ),
                NS(
                    index=0,
                    token_ids=[7, 8],
                    logprobs=lp([7, 8], [-1.0, -2.0]),
                    finish_reason="length",
                ),
            ]
        ),
        NS(
            outputs=[
                NS(index=0, token_ids=[9], logprobs=lp([9], [-3.0]), finish_reason="stop"),
                NS(
                    index=1,
                    token_ids=[4, 4],
                    logprobs=lp([4, 4], [-0.2, -0.3]),
                    finish_reason="length",
                ),
            ]
        ),
    ]
    roll = rv.outputs_to_rollout([[10, 11], [12]], outs, stop_ids=(1, 9))
    assert roll.completion_ids == [[7, 8], [5, 1], [9], [4, 4]]
    assert roll.sampler_logprobs == [[-1.0, -2.0], [-0.5, -0.1], [-3.0], [-0.2, -0.3]]
    assert roll.finished == [False, True, True, False]
    assert roll.group_size == 2


def test_outputs_to_rollout_cuts_at_the_first_stop_id_with_its_logprobs():
    """Tokens after any stop id never reach the trainer; `finished` agrees with the cut."""
    from types import SimpleNamespace as NS

    ids, vals = [5, 9, 6, 1], [-0.1, -0.2, -0.3, -0.4]
    out = NS(
        index=0,
        token_ids=ids,
        logprobs=[{t: NS(logprob=v)} for t, v in zip(ids, vals)],
        finish_reason="stop",
    )
    roll = rv.outputs_to_rollout([[10]], [NS(outputs=[out])], stop_ids=(1, 9))
    assert roll.completion_ids == [[5, 9]] and roll.sampler_logprobs == [[-0.1, -0.2]]
    assert roll.finished == [True]
    roll = rv.outputs_to_rollout([[10]], [NS(outputs=[out])], stop_ids=(2,))
    assert roll.completion_ids == [ids] and roll.finished == [False]


def test_unsloth_backend_without_gpu_is_a_clear_user_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: this checks the CPU-only refusal")
    from ebpo_lite.rollout.unsloth import UnslothRollout, load_unsloth_policy

    cfg = config.load(None, ["rollout.backend=unsloth"])
    with pytest.raises(UserError, match=r"^rollout\.backend=unsloth: needs a CUDA GPU"):
        UnslothRollout(cfg, policy=None)
    with pytest.raises(UserError, match=r"^rollout\.backend=unsloth: needs a CUDA GPU"):
        load_unsloth_policy(cfg)
