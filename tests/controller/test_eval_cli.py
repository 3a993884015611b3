"""`diffrl eval MODEL` (issue 33, defect 9): the output folder of a `toy:`/`tiny:` name has no colon
in its path, and the console shows the headline numbers, every metric going to eval.json."""

from __future__ import annotations

import json

from diffrl.cli import main
from diffrl.toy.grammar import CATEGORIES, builtin_path


def test_eval_of_toy_shapes_writes_a_colon_free_folder_and_prints_the_headline(tmp_path, monkeypatch, capsys):
    rows = builtin_path("heldout", balanced=True).read_text().splitlines()
    by_category = {json.loads(r)["data_source"]: r for r in rows}  # one prompt per category
    (tmp_path / "val.jsonl").write_text("\n".join(by_category.values()) + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "toy:shapes", f"data.val_files=[{tmp_path / 'val.jsonl'}]"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "runs" / "eval" / "toy_shapes"
    assert (out / "eval.json").is_file(), sorted(str(p) for p in tmp_path.rglob("eval.json"))
    assert not any(":" in str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    shown = {line.split()[0] for line in printed.splitlines() if line.startswith("  ")}
    expected = {"val/rewards/mean", "val/accuracy"} | {f"val/{c}/accuracy" for c in CATEGORIES}
    assert shown == expected, printed
    assert len(metrics) > len(shown) and expected <= set(metrics)


def test_eval_with_base_repeats_the_runs_own_first_and_last_validation_side_by_side(
    tmp_path, monkeypatch, capsys
):
    # The base model's validation in `diffrl eval RUN --with-base` must be the run's own step-0
    # validation (same prompts, noise and settings), and the checkpoint's its last one: sample for
    # sample, verdicts and rewards. The run trains one step at a high learning rate so they differ.
    from PIL import Image

    rows = builtin_path("heldout", balanced=True).read_text().splitlines()
    by_category = {json.loads(r)["data_source"]: r for r in rows}
    (tmp_path / "val.jsonl").write_text("\n".join(by_category.values()) + "\n")
    monkeypatch.chdir(tmp_path)
    small = [
        "data.prompts_per_step=4", "actor.mini_batch_size=16", "actor.micro_batch_size=16",
        "actor.optim.lr=3e-2",
        "trainer.total_steps=1", "trainer.test_freq=1", "trainer.check_at_start=false",
        f"data.val_files=[{tmp_path / 'val.jsonl'}]", "trainer.run_name=short",
    ]  # fmt: skip
    assert main(["train", "default", *small]) == 0
    run = tmp_path / "runs" / "short"
    capsys.readouterr()
    assert main(["eval", str(run), "--with-base"]) == 0
    printed = capsys.readouterr().out
    (out,) = (run / "eval").iterdir()  # named after the checkpoint
    for step in (0, 1):
        ours = (out / "validation" / f"step_{step:06d}.jsonl").read_text().splitlines()
        runs = (run / "validation" / f"step_{step:06d}.jsonl").read_text().splitlines()
        assert [json.loads(r) for r in ours] == [json.loads(r) for r in runs], step
    assert (run / "validation" / "step_000000.png").read_bytes() != (
        run / "validation" / "step_000001.png"
    ).read_bytes()
    record = json.loads((out / "eval.json").read_text())
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(m for m in logged if m.get("step") == 0 and "val/accuracy" in m)
    assert record["base"]["val/accuracy"] == first["val/accuracy"]
    base_rows = [json.loads(r) for r in (run / "validation" / "step_000000.jsonl").read_text().splitlines()]
    passed = sum(r["correct"] for r in base_rows)
    assert "base →" in printed and "mean (val/accuracy)" in printed, printed
    assert (
        Image.open(out / "base_vs_trained.png").width
        > Image.open(out / "validation" / "step_000001.png").width
    )
    from diffrl.telemetry.validation_samples import verdict_label

    assert verdict_label("base model", out / "validation" / "step_000000.jsonl") == (
        f"base model: {passed}/{len(base_rows)} pass"
    )
    # a model has no base to compare with: refused, naming the fix
    assert main(["eval", "toy:shapes", "--with-base"]) == 2
    assert "give a run directory" in capsys.readouterr().err
