"""Moved to `trl_ppo.rollout.turn_loop`: this name keeps old imports (and patches) working on the same module."""

import sys

from ..rollout import turn_loop as _moved

sys.modules[__name__] = _moved
