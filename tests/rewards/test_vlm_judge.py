"""`vlm_judge` on tiny random Qwen2.5-VL and Qwen3-VL judges built offline (diffrl.rewards.tiny_vlm).

The reference for every score is computed here by hand: the chat-templated text written out as a
string, the image placeholder expanded to the image's token count, the model called directly and
P(Yes) = softmax(z_yes, z_no)[0] taken from its full-vocabulary logits at the last position."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from diffrl.rewards import MultiReward, build_reward, check_reward_spec, reward_names
from diffrl.rewards.base import takes_sources, to_pil
from diffrl.rewards.registry import spec_needs_sources
from diffrl.rewards.tiny_vlm import save_tiny_vlm
from diffrl.rewards.vlm_judge import DEFAULT_EDIT_TEMPLATE, DEFAULT_QUESTION_TEMPLATE, DEFAULT_TEMPLATE

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
MODEL_CLASSES = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}
SYSTEM = {"qwen2_5_vl": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", "qwen3_vl": ""}
PROMPTS = [
    "a red circle",
    "two blue squares on the left of a small yellow star",
    "a cat",
    "a dog above a cat",
]


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    return {f: save_tiny_vlm(tmp_path_factory.mktemp(f), f, seed=1) for f in FAMILIES}


def _pixels(batch, seed=0, height=40, width=56):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, height, width), dtype=torch.uint8, generator=generator)


def _judge(directory, **args):
    return build_reward("vlm_judge", {"model": str(directory), "device": "cpu", **args})


class ByHand:
    """P(Yes) of one (images, question) query from the model's own forward, nothing shared with the reward."""

    def __init__(self, directory, family):
        self.family = family
        self.model = MODEL_CLASSES[family].from_pretrained(directory).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.images = AutoImageProcessor.from_pretrained(directory)

    def __call__(self, images, question, size=None):
        pil = [Image.fromarray(np.ascontiguousarray(x.permute(1, 2, 0).numpy())) for x in images]
        vision = self.images(images=pil, return_tensors="pt", **({} if size is None else {"size": size}))
        text = SYSTEM[self.family] + "<|im_start|>user\n"
        for grid in vision["image_grid_thw"]:
            text += "<|vision_start|>" + "<|image_pad|>" * (int(grid.prod()) // 4) + "<|vision_end|>"
        text += question + "<|im_end|>\n<|im_start|>assistant\n"
        ids = self.tokenizer(text, return_tensors="pt").input_ids
        image_token = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        with torch.no_grad():
            logits = self.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == image_token).long(),
                pixel_values=vision["pixel_values"],
                image_grid_thw=vision["image_grid_thw"],
            ).logits
        yes, no = self.tokenizer.convert_tokens_to_ids(["Yes", "No"])
        return float(logits[0, -1, [yes, no]].softmax(-1)[0])


def _ask(prompt):
    return DEFAULT_TEMPLATE.replace("{prompt}", prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_score_is_p_yes_of_the_models_own_next_token_logits(judges, family):
    pixels = _pixels(3)
    out = _judge(judges[family])(pixels, PROMPTS[:3], None)
    by_hand = ByHand(judges[family], family)
    expected = torch.tensor([by_hand([pixels[i]], _ask(p)) for i, p in enumerate(PROMPTS[:3])])
    torch.testing.assert_close(out.scores_B, expected, rtol=0, atol=1e-5)
    assert out.scores_B.dtype == torch.float32 and ((out.scores_B > 0) & (out.scores_B < 1)).all()
    assert out.extras["questions"].tolist() == [1.0] * 3
    torch.testing.assert_close(out.extras["min_p_yes"], out.scores_B)


@pytest.mark.parametrize("family", FAMILIES)
def test_batching_and_left_padding_leave_each_score_unchanged(judges, family):
    pixels = _pixels(4, seed=1)
    judge = _judge(judges[family], batch_size=3)  # 4 samples: a batch of 3 (padded to the longest) + 1
    batched = judge(pixels, PROMPTS, None).scores_B
    alone = torch.cat([judge(pixels[i : i + 1], PROMPTS[i : i + 1], None).scores_B for i in range(4)])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)
    assert batched.unique().numel() == 4  # the inputs differ, and so do the answers


def test_several_questions_are_averaged_and_the_rest_ask_the_template(judges):
    pixels = _pixels(2, seed=2)
    questions = ["Is there a cat?", "Is the cat on the left?", "Is there a dog?"]
    rows = [{"questions": questions}, {}]
    out = _judge(judges["qwen2_5_vl"], batch_size=2)(pixels, ["a cat on the left", "a dog"], rows)
    by_hand = ByHand(judges["qwen2_5_vl"], "qwen2_5_vl")
    each = [by_hand([pixels[0]], DEFAULT_QUESTION_TEMPLATE.replace("{question}", q)) for q in questions]
    expected = torch.tensor([sum(each) / 3, by_hand([pixels[1]], _ask("a dog"))])
    torch.testing.assert_close(out.scores_B, expected, rtol=0, atol=1e-5)
    assert out.extras["questions"].tolist() == [3.0, 1.0]
    assert out.extras["min_p_yes"][0] == pytest.approx(min(each), abs=1e-5)
    # questions_key=null: every sample is asked the template
    plain = _judge(judges["qwen2_5_vl"], questions_key=None)(pixels, ["a cat on the left", "a dog"], rows)
    assert plain.scores_B[0] == pytest.approx(by_hand([pixels[0]], _ask("a cat on the left")), abs=1e-5)
    with pytest.raises(ValueError, match=r"sample 0's metadata\['questions'\]=\[\] must be a non-empty list"):
        _judge(judges["qwen2_5_vl"])(pixels[:1], ["a cat"], [{"questions": []}])


@pytest.mark.parametrize("family", FAMILIES)
def test_edit_shows_the_source_then_the_result_with_the_instruction(judges, family):
    result = _pixels(2, seed=3)
    source = _pixels(2, seed=4, height=32, width=32)
    instruction = ["make the circle blue", "add a dog"]
    sources = [(source[0],), (source[1], result[0])]
    judge = _judge(judges[family])
    assert takes_sources(judge)
    out = judge(result, instruction, None, sources=sources)
    by_hand = ByHand(judges[family], family)
    expected = [
        by_hand([source[i], result[i]], DEFAULT_EDIT_TEMPLATE.replace("{prompt}", instruction[i]))
        for i in range(2)
    ]
    torch.testing.assert_close(out.scores_B, torch.tensor(expected), rtol=0, atol=1e-5)
    # source_index picks another condition image; edit=false ignores them; without any, the plain question
    second = _judge(judges[family], source_index=1)(result[1:], instruction[1:], None, sources=sources[1:])
    assert second.scores_B[0] == pytest.approx(
        by_hand([result[0], result[1]], DEFAULT_EDIT_TEMPLATE.replace("{prompt}", "add a dog")), abs=1e-5
    )
    ignoring = _judge(judges[family], edit=False)
    assert not takes_sources(ignoring)
    plain = judge(result, instruction, None, sources=None).scores_B
    torch.testing.assert_close(ignoring(result, instruction, None).scores_B, plain)
    assert plain[0] == pytest.approx(by_hand([result[0]], _ask(instruction[0])), abs=1e-5)
    if family == "qwen2_5_vl":
        with pytest.raises(
            ValueError, match=r"sample 0 has no source image, and .*edit=true judges edits only"
        ):
            _judge(judges[family], edit=True)(result, instruction, None, sources=None)
        with pytest.raises(ValueError, match=r"source_index=1, but sample 0 has 1 source image\(s\)"):
            _judge(judges[family], source_index=1)(result, instruction, None, sources=sources)


def test_through_multi_reward_an_edit_run_hands_it_the_condition_images(judges):
    result = _pixels(2, seed=5)
    source = _pixels(1, seed=6, height=28, width=28)[0]
    rewards = MultiReward({"vlm_judge": {"args": {"model": str(judges["qwen3_vl"]), "device": "cpu"}}})
    out = rewards(result, ["make it red"] * 2, None, [(source,), (source,)])
    direct = _judge(judges["qwen3_vl"])(result, ["make it red"] * 2, None, sources=[(source,), (source,)])
    torch.testing.assert_close(out.scores["vlm_judge"], direct.scores_B)
    assert not spec_needs_sources("vlm_judge")  # text-to-image runs use it too


def test_max_pixels_bounds_each_images_tokens(judges):
    pixels = _pixels(2, seed=11, height=56, width=56)  # 4 tokens' worth at the processor's bound
    judge = _judge(judges["qwen2_5_vl"], max_pixels=28 * 28)
    assert judge.scorer.inputs([([to_pil(pixels[:1])[0]], "Is it?")])["image_grid_thw"].tolist() == [
        [1, 2, 2]
    ]
    by_hand = ByHand(judges["qwen2_5_vl"], "qwen2_5_vl")
    size = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28}
    expected = [by_hand([pixels[i]], _ask(p), size) for i, p in enumerate(PROMPTS[:2])]
    torch.testing.assert_close(
        judge(pixels, PROMPTS[:2], None).scores_B, torch.tensor(expected), rtol=0, atol=1e-5
    )
    assert by_hand([pixels[0]], _ask(PROMPTS[0])) != pytest.approx(
        expected[0], abs=1e-4
    )  # the bound mattered


def test_video_frames_are_judged_one_by_one_and_averaged(judges):
    judge = _judge(judges["qwen2_5_vl"])
    frames = _pixels(4, seed=7)
    per_frame = judge(frames, ["a red circle"] * 2 + ["a cat"] * 2, None).scores_B
    video = judge(frames.reshape(2, 2, 3, 40, 56), ["a red circle", "a cat"], None).scores_B
    torch.testing.assert_close(video, per_frame.reshape(2, 2).mean(dim=1))


def test_bfloat16_scores_close_to_float32(judges):
    pixels = _pixels(2, seed=8)
    full = _judge(judges["qwen2_5_vl"])(pixels, PROMPTS[:2], None).scores_B
    half = _judge(judges["qwen2_5_vl"], dtype="bfloat16")(pixels, PROMPTS[:2], None).scores_B
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0, atol=0.03)


def test_registered_and_its_settings_checked_before_any_model_loads():
    assert "vlm_judge" in reward_names()
    check_reward_spec("vlm_judge", {"model": "/nowhere", "template": "Is this {prompt}?"})  # no load
    with pytest.raises(
        ValueError, match=r"needs argument\(s\) model: set reward\.functions\.vlm_judge\.args\.model"
    ):
        check_reward_spec("vlm_judge", {})
    with pytest.raises(ValueError, match=r"unknown argument 'templte'.*Did you mean 'template'"):
        check_reward_spec("vlm_judge", {"model": "/m", "templte": "x"})


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            {"template": "Is it good?"},
            r"args\.template='Is it good\?' has no \{prompt\} placeholder; write \{prompt\}",
        ),
        ({"edit_template": "Edited?"}, r"args\.edit_template='Edited\?' has no \{prompt\} placeholder"),
        (
            {"question_template": "{prompt}?"},
            r"args\.question_template='\{prompt\}\?' has no \{question\} placeholder",
        ),
        ({"yes_token": "Yes", "no_token": "Yes"}, "are both 'Yes'; they must differ"),
        ({"edit": "sometimes"}, r"args\.edit='sometimes' is invalid: 'auto'"),
        ({"batch_size": 0}, r"args\.batch_size=0 is invalid: must be an integer >= 1"),
        ({"questions_key": ""}, r"args\.questions_key='' must be a metadata key"),
    ],
)
def test_bad_settings_are_errors_naming_the_value_and_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        check_reward_spec("vlm_judge", {"model": "/m", **args})


def test_bad_directories_and_tokens_are_errors_naming_them(judges, tmp_path):
    missing = tmp_path / "no_such_judge"
    with pytest.raises(FileNotFoundError, match=f"args.model='{missing}' does not exist; it must be a local"):
        _judge(missing)
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="model_type='llava'; the judge runs qwen2_5_vl, qwen3_vl"):
        _judge(tmp_path / "llava")
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(FileNotFoundError, match=r"has no weights: expected .*model\.safetensors"):
        _judge(tmp_path / "llava")
    with pytest.raises(
        ValueError, match=r"args\.yes_token='Yes please' is \d+ tokens \(\['Yes', .* it must be one token"
    ):
        _judge(judges["qwen2_5_vl"], yes_token="Yes please")
    with pytest.raises(ValueError, match=r"max_pixels=100 is below the image processor's minimum of 784"):
        _judge(judges["qwen2_5_vl"], max_pixels=100)


def test_served_over_http_it_scores_as_it_does_in_process(judges):
    from diffrl.rewards.server import start_reward_server

    result = _pixels(2, seed=9)
    source = _pixels(1, seed=10, height=28, width=28)[0]
    rows = [{"questions": ["Is there a cat?", "Is it red?"]}, {}]
    judge = _judge(judges["qwen2_5_vl"])
    local = judge(result, ["make it red", "add a cat"], rows, sources=[(source,), (source,)])
    with start_reward_server("vlm_judge", {"model": str(judges["qwen2_5_vl"]), "device": "cpu"}) as server:
        client = build_reward("http", {"url": server.url, "timeout": 30})
        assert client.health()["sources"] is True
        remote = client(result, ["make it red", "add a cat"], rows, sources=[(source,), (source,)])
    # PNG on the wire is lossless: the very same pixels, so the same scores
    torch.testing.assert_close(remote.scores_B, local.scores_B, rtol=0, atol=1e-6)
    torch.testing.assert_close(remote.extras["min_p_yes"], local.extras["min_p_yes"], rtol=0, atol=1e-6)
