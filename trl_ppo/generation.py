"""Moved to `trl_ppo.rollout.generation`: this name keeps old imports (and patches) working on the same module."""

import sys

from .rollout import generation as _moved

sys.modules[__name__] = _moved
