"""The distillation loop (DMD2) on the tiny random SD3, on CPU: the roles stay apart (the fake
score's update moves only the fake adapter, the student's only the student, the teacher never
moves), the two time-scale schedule, the draws, and `diffrl train` end to end."""

import json

import pytest
import torch

from diffrl.algos.dmd2 import FAKE_SCORE
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.distillation import check_distillation
from diffrl.telemetry import read_metrics
from diffrl.train.engine import POLICY, REFERENCE
from diffrl.workers.distillation_worker import DistillationWorker
from diffrl.workers.roles import PromptShard

DISTILL = [
    "algorithm.trainer_type=distillation",
    "actor.loss.mode=dmd2",
    "rollout.n=2",
    "rollout.pipeline.num_inference_steps=2",
    "rollout.pipeline.guidance_scale=1.0",
    "rollout.sde.window_range=[0,2]",
    "data.prompts_per_step=4",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=4",
    "trainer.check_at_start=false",
]


def _cfg(tmp_path, *overrides):
    return load_config("tiny_sd3", [*DISTILL, f"trainer.output_dir={tmp_path}", *overrides])


def _adapter(worker, name):
    return {
        n: p.detach().clone() for n, p in worker.engine.transformer.named_parameters() if f".{name}." in n
    }


def _changed(before, after):
    return sum(not torch.equal(before[k], after[k]) for k in before)


def _shard(prompts):
    return PromptShard(prompts, [str(i) for i in range(len(prompts))], [{}] * len(prompts), None, 0)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("dmd"), "actor.loss.dmd_teacher_guidance=3.0")
    return DistillationWorker(cfg)


def _teacher_output(worker):
    adapter, pipe = worker.engine.adapter, worker.cfg.rollout.pipeline
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *adapter.latent_shape(pipe.height, pipe.width), generator=g)
    cond = adapter.encode_prompts(["a cat", "a dog"], None, max_sequence_length=pipe.max_sequence_length)
    with torch.no_grad(), worker.engine.use_policy(REFERENCE):
        return adapter.velocity(x, torch.full((2,), 500.0), cond, 1.0, pipe.height, pipe.width)


def test_each_update_moves_only_its_own_adapter_and_the_teacher_never(worker):
    teacher = _teacher_output(worker)
    student, fake = _adapter(worker, POLICY), _adapter(worker, FAKE_SCORE)
    assert student and fake and student.keys().isdisjoint(fake.keys())

    worker.distill_stage(_shard(["a cat", "a dog"]), seed=0, step=1)  # 4 samples
    metrics = worker.fake_score_update(1)
    assert metrics["fake_score_loss"] > 0
    assert _changed(fake, _adapter(worker, FAKE_SCORE)) > 0
    assert _changed(student, _adapter(worker, POLICY)) == 0
    fake = _adapter(worker, FAKE_SCORE)

    metrics = worker.student_update()
    assert {"dmd_loss", "dmd_normaliser", "teacher_fake_gap", "grad_norm"} <= metrics.keys()
    # the student's LoRA B starts at zero, so its first step moves B: the student changes
    assert _changed(student, _adapter(worker, POLICY)) > 0
    assert _changed(fake, _adapter(worker, FAKE_SCORE)) == 0
    assert worker.distill_counts() == {"student_steps": 1, "fake_score_steps": 1}
    torch.testing.assert_close(_teacher_output(worker), teacher, rtol=0, atol=0)
    # after the update the trained adapter is the student again, and only its tensors require grad
    trainable = {n for n, p in worker.engine.transformer.named_parameters() if p.requires_grad}
    assert trainable and all(f".{POLICY}." in n for n in trainable)


def test_a_student_update_needs_staged_samples(worker):
    with pytest.raises(RuntimeError, match="stage"):
        worker.student_update()


def test_staged_samples_depend_on_their_keys_not_on_the_batch(worker):
    worker.distill_stage(_shard(["a cat", "a dog"]), seed=3, step=5)
    both = worker.distiller.staged
    worker.distill_stage(
        PromptShard(["a dog"], ["1"], [{}], None, sample_offset=2), seed=3, step=5
    )  # the same samples 2 and 3, alone
    alone = worker.distiller.staged
    torch.testing.assert_close(alone.latents, both.latents[2:], rtol=0, atol=1e-6)
    torch.testing.assert_close(alone.sigmas_B, both.sigmas_B[2:], rtol=0, atol=0)
    worker.distiller.staged = None


def test_the_loop_is_refused_where_it_does_not_run_yet(tmp_path):
    check_distillation(_cfg(tmp_path))
    with pytest.raises(ValueError, match="one colocated worker"):
        check_distillation(_cfg(tmp_path, "trainer.n_gpus_per_node=2"))
    with pytest.raises(ValueError, match="LoRA"):
        check_distillation(_cfg(tmp_path, "model.lora.rank=0"))


def test_diffrl_train_runs_the_distillation_loop(tmp_path, monkeypatch):
    counts = []
    real = DistillationWorker.student_update

    def counted(self):
        out = real(self)
        counts.append(self.distill_counts())
        return out

    monkeypatch.setattr(DistillationWorker, "student_update", counted)
    args = [
        *DISTILL,
        "actor.loss.dmd_fake_updates=3",
        "trainer.total_steps=2",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        f"trainer.output_dir={tmp_path}",
        "trainer.run_name=dmd",
    ]
    assert main(["train", "tiny_sd3", *args]) == 0
    # three fake-score steps before each student step
    assert counts == [
        {"student_steps": 1, "fake_score_steps": 3},
        {"student_steps": 2, "fake_score_steps": 6},
    ]
    rows = read_metrics(tmp_path / "dmd" / "metrics.jsonl")
    assert [step for step, row in rows.items() if "actor/dmd_loss" in row] == [1, 2]
    assert all(rows[step]["distill/fake_updates"] == 3.0 for step in (1, 2))
    assert "timing_s/fake_score_update" in rows[1] and "val/rewards/mean" in rows[2]
    assert (tmp_path / "dmd" / "export").is_dir()
    assert (tmp_path / "dmd" / "checkpoints").is_dir()
    # diffrl eval loads the run's checkpoint (both adapters) and validates the student as the run did
    assert main(["eval", str(tmp_path / "dmd"), "--out", str(tmp_path / "eval")]) == 0
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert evaluated["step"] == 2
    assert evaluated["metrics"]["val/rewards/mean"] == pytest.approx(rows[2]["val/rewards/mean"], abs=1e-6)
