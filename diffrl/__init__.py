"""diffrl: RL post-training for diffusion and flow-matching generative models.

Importing diffrl registers the built-in algorithms, rewards and the shapes world's models with the
config (`diffrl.config.registries`): the config imports none of them (DESIGN.md, "Layers"), so this
package root is where they are put in its tables, before any config is read. None of them imports
torch at import time.
"""

__version__ = "0.1.0"

# Registration on import, in this order: actor.loss.mode and algorithm.adv_estimator; reward.functions;
# model.path=tiny:toy, toy:shapes, ...
from diffrl import algos, rewards, toy  # noqa: F401
