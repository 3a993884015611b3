"""benchmarks/shapes_ema.py on a tiny CPU run of the default job. Two decays have closed forms: an
EMA at decay 0 is the final weights, so it must validate exactly as the run's last validation did;
at decay 1 it never leaves the initial adapter (LoRA's B is zero: the base policy), so it must
validate exactly as the step-0 validation did (the learning rate is high enough that the final
validation differs from the step-0 one, so the two checks are not the same check), and the run's
exported weights must still be the final ones. Only those two decays run: each EMA is one more
validation, and decay 1 validated after decay 0 (the final weights) already shows that each EMA is
validated with its own weights."""

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shapes_ema

from diffrl.toy.grammar import balanced_rows


def test_ema_closed_forms_on_a_tiny_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in balanced_rows("heldout", 2)))
    result = shapes_ema.main(
        [
            "--decays", "0,1", "--warmup-decays", "",
            "--",
            "default",
            "trainer.total_steps=2", "trainer.test_freq=2", "data.prompts_per_step=4",
            "trainer.check_at_start=false",  # the start-up check is not what this tests
            "actor.mini_batch_size=16", "actor.micro_batch_size=16", "actor.optim.lr=3e-2",
            f"data.val_files=[{val}]", "trainer.run_name=ema",
        ]
    )  # fmt: skip
    assert result["optimizer_steps"] == 2
    assert result["final"] != result["before"]
    assert result["ema_0"] == result["final"]
    assert result["ema_1"] == result["before"]
    assert set(result["final"]) >= {"val/accuracy", "val/position/accuracy"}
    run_dir = Path(result["run_dir"])
    assert json.loads((run_dir / "ema_validation.json").read_text()) == result
    # the EMAs' images go to their own folders: the run's step-2 validation (the report's "after")
    # stays the final weights', not the last EMA's (decay 1: the base policy's samples)
    own = (run_dir / "validation" / "step_000002.jsonl").read_text()
    assert own != (run_dir / "ema" / "ema_1" / "validation" / "step_000002.jsonl").read_text()
    assert own == (run_dir / "ema" / "ema_0" / "validation" / "step_000002.jsonl").read_text()
    # the final weights were put back: the exported LoRA is not the last EMA validated (decay 1, zero B)
    exported = load_file(next((run_dir / "export").glob("*.safetensors")))
    assert any(t.abs().max() > 0 for k, t in exported.items() if "lora_B" in k)


def test_bad_decays_are_refused():
    with pytest.raises(SystemExit, match=r"outside \[0, 1\]"):
        shapes_ema.parse_decays("0.5,1.5", "--decays")
    with pytest.raises(SystemExit, match="comma-separated"):
        shapes_ema.parse_decays("0.5;0.9", "--decays")
