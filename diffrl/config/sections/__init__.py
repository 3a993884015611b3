"""The config's top-level sections, one module per key (`rollout.*` in rollout.py, ...).

Import them from `diffrl.config.schema` (or `diffrl.config`), which nests them in the root `Config`.
"""
