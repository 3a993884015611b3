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
