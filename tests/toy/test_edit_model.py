"""The shapes edit task's model: a pixel-space FLUX.1 Kontext through the real edit-family adapter."""

import pytest
import torch
from PIL import Image

from diffrl.models import load_model, read_model_index
from diffrl.models.flux_kontext import FluxKontextAdapter
from diffrl.toy.edit import edit_examples, instructions, render_example
from diffrl.toy.edit_model import EDIT_WORDS, TEXT_TOKENS


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(tiny_model("toy_edit"), "float32")


def test_directory_is_a_pixel_space_kontext_pipeline(tiny_model, model):
    index = read_model_index(tiny_model("toy_edit"))
    assert index["_class_name"] == "FluxKontextPipeline" and index["vae"] == [None, None]
    assert isinstance(model, FluxKontextAdapter) and model.pixel_space
    assert model.latent_shape(32, 32) == (256, 12)  # 16x16 tokens of RGB packed 2x2
    assert 1e6 < sum(p.numel() for p in model.transformer.parameters()) < 5e6


def test_every_instruction_word_is_one_token(model):
    texts = instructions("train") + instructions("heldout")
    assert set(EDIT_WORDS) <= {w for t in texts for w in t.split()}
    for text in texts:
        words = text.split()
        assert len(model.pipe.tokenizer.tokenize(text)) == len(words), text
        assert len(model.pipe.tokenizer_2.tokenize(text)) == len(words), text
        assert len(words) + 1 <= TEXT_TOKENS  # with T5's end token


def test_pixels_round_trip_and_the_condition_is_the_source_packed(model):
    examples = edit_examples("train", 1)
    pairs = [render_example(e, 32) for e in examples]
    targets = torch.stack([torch.from_numpy(t).permute(2, 0, 1) for _, t in pairs])
    latents = model.encode(targets)
    assert latents.shape == (5, 256, 12) and float(latents.abs().max()) <= 1.0
    assert torch.equal(model.decode(latents, 32, 32), targets)
    sources = [[Image.fromarray(s)] for s, _ in pairs]
    cond = model.encode_conditioned([e.instruction() for e in examples], None, TEXT_TOKENS, sources)
    source_pixels = torch.stack([torch.from_numpy(s).permute(2, 0, 1) for s, _ in pairs])
    torch.testing.assert_close(cond.cond_latents, model.encode(source_pixels))
    assert cond.cond_shapes.tolist() == [[[16, 16]]] * 5
    velocity = model.velocity(latents, torch.full((5,), 500.0), cond, 1.0, 32, 32)
    assert velocity.shape == latents.shape and torch.isfinite(velocity).all()


def test_errors_name_the_fix(model):
    with pytest.raises(ValueError, match="there is no pipeline call to compare"):
        model.pipeline_call(
            ["make the circle red"],
            None,
            num_inference_steps=2,
            guidance_scale=1.0,
            true_cfg_scale=None,
            height=32,
            width=32,
            num_frames=1,
            max_sequence_length=TEXT_TOKENS,
            images=[[Image.new("RGB", (32, 32))]],
        )
    with pytest.raises(ValueError, match="packs condition images 2x2"):
        model.encode_conditioned(["x"], None, TEXT_TOKENS, [[Image.new("RGB", (33, 32))]])
    with pytest.raises(ValueError, match="multiples of 2"):
        model.encode(torch.zeros(1, 3, 31, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="every prompt needs its condition image"):
        model.encode_prompts(["make the circle red"], None, TEXT_TOKENS)
