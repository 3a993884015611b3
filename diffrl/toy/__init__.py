"""The shapes world: a miniature GenEval that needs no downloads.

Coloured circles, squares and triangles on a white background, described by a small prompt
grammar, drawn exactly by a renderer and checked exactly by a verifier, so a text-to-image model
can be trained, rewarded and evaluated end to end on a CPU:

- `grammar`: palette, shapes, the six GenEval-like categories, `Scene` (a prompt's meaning),
  `parse_prompt`, the train / held-out split and the built-in prompt files.
- `render`: `render(scene, size, generator)` draws a correct image of a scene (SFT data);
  `corrupt(scene, generator)` a deliberately wrong scene for the same prompt (negatives).
- `verify`: `verify(image, scene)` reads an image and checks every constraint of the scene
  (the `shapes` reward, `diffrl.rewards.shapes`, is this verifier).
- `model`: the tiny pixel-space SD3 trained on the renderer's images.
- `edit`: the edit task: an instruction that changes one thing of a source scene (`Edit`), its
  concrete layouts (`draw_example`), the train / held-out split of instructions and the built-in
  edit prompt files; `edit_verify`: the result's check (the `shapes_edit` reward); `edit_model`:
  the tiny pixel-space FLUX.1 Kontext that `diffrl sft shapes_edit_sft` trains.

docs/shapes.md is the user guide. Submodules are imported explicitly (`from diffrl.toy.grammar
import Scene`), so importing one never pulls in diffusers.

The shapes world plugs into diffrl as a user's task would: its models register here with the
config's tables (`model.path=tiny:toy`, `tiny:toy_edit`: the untrained initialisations that
`diffrl sft` trains; `toy:shapes`, `toy:shapes_edit`: the trained ones in `pretrained/`), its
rewards in `diffrl.rewards.shapes` / `shapes_edit`, its prompt files as `builtin:` data.
"""

from pathlib import Path
from typing import Any

from diffrl.config.registries import register_shipped_models, register_tiny_model
from diffrl.data.images import register_drawn_images

#: The trained models shipped with the package (`model.path=toy:<name>`).
PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"

register_tiny_model("toy", "diffrl.toy.model")  # the shapes world's model, untrained (`diffrl sft` trains it)
register_tiny_model("toy_edit", "diffrl.toy.edit_model:build_toy_edit")  # the edit task's model, untrained
register_shipped_models(PRETRAINED_DIR)

#: `sft.images` values whose images the shapes world draws: a scene (text-to-image) or an edit.
SHAPES = "shapes"
SHAPES_EDIT = "shapes_edit"


def draw_scene(row: Any, size: int, seed: int) -> Any:
    """A correct image of the row's scene (`scene` dict), drawn with a numpy generator seeded by `seed`."""
    import numpy as np

    from diffrl.toy.grammar import Scene
    from diffrl.toy.render import render

    return render(Scene.from_dict(row), size=size, generator=np.random.default_rng(seed))


def draw_edit(row: Any, size: int, seed: int) -> Any:
    """[2, size, size, 3]: the target, then the source (the condition image) of the row's edit
    (`EditExample.to_dict()`), drawn afresh from `seed` (`diffrl.toy.edit.draw_example`: the row's
    edit, a new layout)."""
    import numpy as np

    from diffrl.toy.edit import EditExample, draw_example, render_example

    edit = EditExample.from_dict(row).edit
    condition, target = render_example(draw_example(edit, size, np.random.default_rng(seed)), size)
    return np.stack([target, condition])


register_drawn_images(SHAPES, draw_scene)
register_drawn_images(SHAPES_EDIT, draw_edit)
