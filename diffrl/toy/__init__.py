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

docs/shapes.md is the user guide. Submodules are imported explicitly (`from diffrl.toy.grammar
import Scene`), so importing one never pulls in diffusers.
"""
