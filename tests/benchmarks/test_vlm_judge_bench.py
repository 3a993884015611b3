"""benchmarks/vlm_judge.py: its `--tiny` CPU smoke mode end to end (one JSON line, scores in [0, 1]),
and the full-size judge's build path (config, save, marker, reuse, refusal) on a shrunk copy of the
architecture, loaded and scored through the reward as the GPU run does. The full architecture's
parameter count is checked on the meta device (no memory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vlm_judge  # noqa: E402

ROW_KEYS = {
    "size",
    "batch_size",
    "images",
    "images_per_s",
    "wall_s",
    "processor_s",
    "vision_s",
    "language_s",
    "other_s",
    "tokens_per_image",
    "tokens_per_question",
    "peak_gb",
    "score_min",
    "score_mean",
    "score_max",
    "scores_finite",
}
# The same architecture, one layer and narrow: the build path on a CPU in a second.
SHRUNK = {
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
    },
    "vision": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
    },
}


def check_rows(result: dict, sizes: list[int], batch_sizes: list[int], images: int) -> None:
    assert [(r["size"], r["batch_size"]) for r in result["runs"]] == [
        (s, b) for s in sizes for b in batch_sizes
    ]
    for row in result["runs"]:
        assert set(row) == ROW_KEYS
        assert row["images"] == images and row["images_per_s"] > 0 and row["scores_finite"]
        assert 0.0 <= row["score_min"] <= row["score_mean"] <= row["score_max"] <= 1.0
        assert row["tokens_per_question"] > row["tokens_per_image"] > 0


def test_tiny_mode_prints_one_json_line_with_scores_in_unit_interval(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vlm_judge.py"), "--tiny", "--device", "cpu"]
    cmd += ["--build", str(tmp_path / "judge"), "--images", "4", "--batch-sizes", "2", "4", "--with-recipe"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1  # progress goes to stderr
    result = json.loads(lines[0])
    assert (
        result["bench"] == "vlm_judge"
        and result["device"] == "cpu"
        and result["judge"] == "tiny_vlm qwen2_5_vl"
    )
    assert result["load_s"] >= 0 and result["weights_gb"] is None
    check_rows(result, [512, 1024], [2, 4], 4)
    assert "reward.functions.vlm_judge.args.model=" + str(tmp_path / "judge") in result["recipe_command"]


def test_full_architecture_is_qwen25_vl_7b_sized():
    import transformers

    from diffrl.rewards.tiny_vlm import tiny_qwen2_tokenizer

    config = vlm_judge.judge_config(tiny_qwen2_tokenizer())
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 8_292_166_656  # Qwen2.5-VL-7B-Instruct's
    assert set(config.text_config.layer_types) == {"full_attention"}


def test_build_path_writes_a_judge_the_reward_loads_then_reuses_it(tmp_path):
    directory = tmp_path / "judge"
    timings = vlm_judge.build_judge(directory, "cpu", overrides=SHRUNK)
    assert set(timings) == {"build_s", "save_s"}
    assert (directory / vlm_judge.MARKER).is_file() and not (tmp_path / "judge.partial").exists()
    assert vlm_judge.build_judge(directory, "cpu", overrides=SHRUNK) == {}  # the marker matches: reused
    with pytest.raises(SystemExit, match="not this benchmark's judge"):
        vlm_judge.build_judge(directory, "cpu")  # another spec: refused, never overwritten
    result = vlm_judge.main(
        [
            "--model",
            str(directory),
            "--device",
            "cpu",
            "--sizes",
            "112",
            "--images",
            "2",
            "--batch-sizes",
            "2",
        ]
    )
    check_rows(result, [112], [2], 2)
    assert result["runs"][0]["tokens_per_image"] == 16  # 112² px / 28² px per token: the real processor
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["text_config"]["vocab_size"] == 152064
