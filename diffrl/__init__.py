"""diffrl: RL post-training for diffusion and flow-matching generative models."""

__version__ = "0.1.0"
