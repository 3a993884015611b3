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
"""
