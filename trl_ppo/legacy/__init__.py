"""TRL's first PPOTrainer (trl <= 0.11), on trl_ppo's core: scripts written for it run with their imports changed.

    from trl_ppo.legacy import PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead, create_reference_model
    from trl_ppo.legacy.core import LengthSampler, respond_to_batch

The user owns the loop (`generate` → score → `step(queries, responses, scores)` → `log_stats`); each `step()` is
one update of trl_ppo's own pipeline (`trl_ppo.PPOTrainer.update_on_episodes`). What differs from trl 0.11, and
why, is in the README ("Coming from TRL's first PPOTrainer").
"""

from .config import PPOConfig
from .core import LengthSampler, respond_to_batch, set_seed
from .models import AutoModelForCausalLMWithValueHead, create_reference_model
from .trainer import PPOTrainer

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "LengthSampler",
    "PPOConfig",
    "PPOTrainer",
    "create_reference_model",
    "respond_to_batch",
    "set_seed",
]
