"""Tests of ebpo_lite.algo.curriculum: determinism, coverage, ordering, resume, adaptive, DAPO filter."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from ebpo_lite.algo.curriculum import (
    SAMPLERS,
    PromptSampler,
    informative_groups,
    make_sampler,
)
from ebpo_lite.errors import ConfigError

torch.set_num_threads(1)

N = 23
TOPICS = [["alg", "geo", None, "calc"][i % 4] for i in range(N)]  # "other" = the None ones
LEVELS = [float(1 + i % 3) for i in range(N)]


def build(name: str, seed: int = 0, **kw) -> PromptSampler:
    """Every sampler over the same data (topics and levels given to all, as the trainer does)."""
    kw.setdefault("topics", TOPICS)
    kw.setdefault("difficulties", LEVELS)
    kw.setdefault("difficulty_is_pass_rate", False)
    return make_sampler(name, N, seed, **kw)


def draw(s: PromptSampler, sizes: list[int]) -> list[list[int]]:
    return [s.next_batch(n) for n in sizes]


# -- determinism -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SAMPLERS)
def test_same_seed_same_sequence_other_seed_differs(name):
    sizes = [5, 7, 3, 5, 8, 5]
    a, b, c = build(name, 3), build(name, 3), build(name, 4)
    seq_a, seq_b, seq_c = draw(a, sizes), draw(b, sizes), draw(c, sizes)
    assert seq_a == seq_b
    assert seq_a != seq_c
    assert all(len(batch) == n for batch, n in zip(seq_a, sizes))
    assert all(0 <= i < N and isinstance(i, int) for batch in seq_a for i in batch)


# -- shuffle -----------------------------------------------------------------------------------
def test_shuffle_covers_every_example_once_per_epoch():
    s = make_sampler("shuffle", N, 7)
    flat = [i for batch in draw(s, [4] * 23) for i in batch]  # 92 = 4 epochs of 23
    epochs = [flat[k * N : (k + 1) * N] for k in range(4)]
    for ep in epochs:
        assert sorted(ep) == list(range(N))
    assert epochs[0] != epochs[1]  # a fresh permutation each epoch
    assert epochs[0] != list(range(N))  # actually shuffled
    assert s.stats()["epoch"] == pytest.approx(4.0)


def test_shuffle_batch_larger_than_dataset_spans_epochs():
    s = make_sampler("shuffle", 3, 0)
    batch = s.next_batch(7)
    assert Counter(batch) == Counter({0: 2, 1: 2, 2: 2}) + Counter({batch[-1]: 1})
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]


# -- topic -------------------------------------------------------------------------------------
def topic_of(i: int) -> str:
    return TOPICS[i] or "other"


def test_topic_runs_are_coherent_and_cycle_in_first_appearance_order():
    s = build("topic", run_length=3)
    assert s.topic_order == ["alg", "geo", "other", "calc"]
    batches = draw(s, [2] * 24)  # 24 batches = 2 full cycles of 4 topics x 3 batches
    topics = [{topic_of(i) for i in b} for b in batches]
    assert all(len(t) == 1 for t in topics)  # every batch is topic-coherent
    seq = [t.pop() for t in topics]
    assert seq == [t for t in ["alg", "geo", "other", "calc"] * 2 for _ in range(3)]


def test_topic_order_configurable_rest_appended_and_topic_pass_covers_members():
    s = build("topic", topic_order=["calc", "other"], run_length=1)
    assert s.topic_order == ["calc", "other", "alg", "geo"]
    calc = [i for i in range(N) if TOPICS[i] == "calc"]  # 5 examples
    first = s.next_batch(5)
    assert sorted(first) == calc  # one run of 5 covers the topic once, shuffled
    assert s.current_topic == "calc"
    assert s.next_batch(2)[0] in [i for i in range(N) if TOPICS[i] is None]
    assert s.stats()["topic_index"] == 1.0


def test_topic_position_carries_over_between_runs():
    s = build("topic", run_length=1)
    alg = [i for i in range(N) if TOPICS[i] == "alg"]  # 6 examples
    got = []
    for _ in range(3):  # three cycles: alg gets 3 batches of 2
        got += s.next_batch(2)
        draw(s, [2, 2, 2])  # the other three topics
    assert sorted(got) == alg  # alg's members each once over its three runs


def test_topic_errors():
    with pytest.raises(ValueError, match="topics"):
        make_sampler("topic", N, 0)
    with pytest.raises(ConfigError, match=r"^curriculum\.topic_order: \['nope'\] not among"):
        build("topic", topic_order=["nope"])
    with pytest.raises(ConfigError, match="repeats"):
        build("topic", topic_order=["alg", "alg"])
    with pytest.raises(ValueError, match="run_length"):
        build("topic", run_length=0)


# -- difficulty --------------------------------------------------------------------------------
def test_difficulty_levels_easy_to_hard_ties_shuffled_then_stop():
    s = build("difficulty", repeat=False)
    batches = []
    with pytest.raises(StopIteration):
        while True:
            batches.append(s.next_batch(5))
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]  # short last batch, then stop
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(N))  # one pass covers everything once
    levels = [LEVELS[i] for i in flat]
    assert levels == sorted(levels)  # easy (level 1) to hard (level 3)
    level1 = [i for i in flat if LEVELS[i] == 1.0]
    assert level1 != sorted(level1)  # ties shuffled, not index order
    with pytest.raises(StopIteration):  # stays exhausted
        s.next_batch(1)


def test_difficulty_pass_rates_high_first_missing_last():
    rates = [0.1, None, 0.9, 0.5, float("nan"), 0.5, 1.0, 0.0]
    s = make_sampler("difficulty", 8, 1, difficulties=rates, repeat=False)
    order = s.next_batch(8)
    assert order[:2] == [6, 2]  # pass rate 1.0 then 0.9 (easiest first)
    assert sorted(order[2:4]) == [3, 5]  # the 0.5 tie
    assert order[4:6] == [0, 7]  # 0.1 then 0.0
    assert sorted(order[6:]) == [1, 4]  # None and NaN last


def test_difficulty_repeat_starts_a_new_pass_with_new_tie_order():
    s = build("difficulty", repeat=True)
    first = s.next_batch(N)
    second = s.next_batch(N)
    assert [LEVELS[i] for i in second] == sorted(LEVELS)
    assert first != second and sorted(first) == sorted(second)
    assert s.stats()["epoch"] == pytest.approx(2.0)


def test_difficulty_errors():
    with pytest.raises(ValueError, match="difficulties"):
        make_sampler("difficulty", N, 0)
    with pytest.raises(ValueError, match=r"difficulties\[0\] = 2.0.*difficulty_is_pass_rate"):
        make_sampler("difficulty", 2, 0, difficulties=[2.0, 0.5])
    with pytest.raises(ValueError, match="finite"):
        make_sampler("difficulty", 2, 0, difficulties=[float("inf"), 0.5])


# -- resume ------------------------------------------------------------------------------------
def feed(s: PromptSampler, batch: list[int], rng: random.Random) -> None:
    """Rewards with per-example pass rate (i % 5) / 4, so the adaptive sampler has something."""
    s.update(batch, [[float(rng.random() < (i % 5) / 4) for _ in range(4)] for i in batch])


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("cut", [1, 3, 6])  # mid-epoch, mid-run and across an epoch boundary
def test_state_round_trip_through_json_continues_exactly(name, cut):
    sizes = [5, 6, 5, 9, 5, 6, 5, 5, 7, 5]
    ref = build(name, 11)
    rng = random.Random(0)
    straight = []
    for n in sizes:
        straight.append(ref.next_batch(n))
        feed(ref, straight[-1], rng)

    first = build(name, 11)
    rng = random.Random(0)
    resumed = []
    for n in sizes[:cut]:
        resumed.append(first.next_batch(n))
        feed(first, resumed[-1], rng)
    state = json.loads(json.dumps(first.state_dict()))
    second = build(name, 11)
    second.load_state_dict(state)
    for n in sizes[cut:]:
        resumed.append(second.next_batch(n))
        feed(second, resumed[-1], rng)
    assert resumed == straight
    assert second.state_dict() == ref.state_dict()


def test_resume_of_exhausted_difficulty_stays_exhausted():
    s = build("difficulty", repeat=False)
    s.next_batch(N)
    t = build("difficulty", repeat=False)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    with pytest.raises(StopIteration):
        t.next_batch(1)


def test_load_refuses_a_different_curriculum():
    state = build("shuffle", 1).state_dict()
    with pytest.raises(ValueError, match="sampler"):
        build("topic", 1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        build("shuffle", 2).load_state_dict(state)
    topic_state = build("topic", 1, run_length=2).state_dict()
    with pytest.raises(ValueError, match="fingerprint"):
        build("topic", 1, run_length=3).load_state_dict(topic_state)
    bad = build("adaptive", 1).state_dict()
    bad["trials"] = bad["trials"][:-1]
    with pytest.raises(ValueError, match="adaptive counts"):
        build("adaptive", 1).load_state_dict(bad)


# -- adaptive ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["thompson", "mean"])
def test_adaptive_concentrates_on_mid_difficulty(mode):
    n, g, steps, batch = 60, 8, 60, 10
    true_p = [(0.0, 0.5, 1.0)[i % 3] for i in range(n)]  # 20 each: never, half, always solved
    s = make_sampler("adaptive", n, 5, adaptive_mode=mode)
    rng = np.random.default_rng(0)
    picks = []
    for _ in range(steps):
        idx = s.next_batch(batch)
        assert len(set(idx)) == batch  # without replacement within a batch
        rewards = torch.tensor(rng.random((batch, g)) < np.array(true_p)[idx, None]).float()
        s.update(idx, rewards)
        picks.append(idx)
    late = [i for b in picks[steps // 2 :] for i in b]
    frac_mid = np.mean([true_p[i] == 0.5 for i in late])
    assert frac_mid > 0.9  # uniform sampling would give 1/3
    assert s.stats()["seen_frac"] == 1.0  # unseen prompts (prior mean 0.5) were explored first
    assert 0.3 < s.stats()["batch_mean_p"] < 0.7


def test_adaptive_posterior_counts_clip_nan_and_means():
    s = make_sampler("adaptive", 4, 0, prior=(2.0, 3.0))
    s.update([0, 1], torch.tensor([[1.0, 0.0, float("nan")], [2.0, -1.0, 0.5]]))
    s.update([3, 3], [0.25, 0.75])  # per-prompt means: one trial each, repeated index adds up
    alpha, beta = s.posterior()
    # row 0: 1 success out of 2 valid; row 1: clip to 1, 0, 0.5 -> 1.5 of 3; example 3: 1.0 of 2
    assert alpha.tolist() == [3.0, 3.5, 2.0, 3.0]
    assert beta.tolist() == [4.0, 4.5, 3.0, 4.0]
    assert "batch_mean_p" not in s.stats()


def test_adaptive_errors():
    with pytest.raises(ValueError, match="exceeds"):
        make_sampler("adaptive", 3, 0).next_batch(4)
    with pytest.raises(ValueError, match="prior"):
        make_sampler("adaptive", 3, 0, prior=(0.0, 1.0))
    with pytest.raises(ValueError, match="adaptive_mode"):
        make_sampler("adaptive", 3, 0, adaptive_mode="greedy")
    with pytest.raises(ValueError, match="target"):
        make_sampler("adaptive", 3, 0, target=1.5)


# -- common errors -----------------------------------------------------------------------------
def test_argument_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown name 'bogus'"):
        make_sampler("bogus", 3, 0)
    with pytest.raises(ValueError, match="n_examples"):
        make_sampler("shuffle", 0, 0)
    with pytest.raises(ValueError, match="seed"):
        make_sampler("shuffle", 3, "0")
    with pytest.raises(ValueError, match="topics: has 2 entries for 3"):
        make_sampler("shuffle", 3, 0, topics=["a", "b"])
    with pytest.raises(ValueError, match="difficulties: has 4 entries for 3"):
        make_sampler("shuffle", 3, 0, difficulties=[1, 2, 3, 4])
    s = make_sampler("shuffle", 3, 0)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n must be"):
            s.next_batch(bad)
    with pytest.raises(ValueError, match="rewards of shape"):
        s.update([0, 1], [[1.0, 0.0]])
    with pytest.raises(ValueError, match="index 5"):
        s.update([5], [[1.0]])
    s.update([0], torch.ones(1, 4, requires_grad=True))  # non-adaptive: checked, then ignored
    assert s.stats()["batches"] == 0.0


def test_negative_seed_works_and_is_deterministic():
    a, b = make_sampler("shuffle", 5, -3), make_sampler("shuffle", 5, -3)
    assert a.next_batch(5) == b.next_batch(5)


# -- DAPO dynamic sampling filter --------------------------------------------------------------
def test_informative_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert informative_groups(r).tolist() == [False, True, False, True]
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    # row 1: only the two zeros count; row 3: a single scorable reward is never informative
    assert informative_groups(r, mask).tolist() == [False, False, False, False]
    assert informative_groups([[0.0, 1.0]]).tolist() == [True]
    with pytest.raises(ValueError, match="rewards"):
        informative_groups(torch.zeros(3))
    with pytest.raises(ValueError, match="mask"):
        informative_groups(r, mask[:, :2])
