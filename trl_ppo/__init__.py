"""trl_ppo: PPO (RLHF) for language models, a maintained successor of TRL's PPOv2 trainer.

Migrating from TRL: `from trl.experimental.ppo import PPOConfig, PPOTrainer` becomes
`from trl_ppo import PPOConfig, PPOTrainer`.
"""

from . import quiet  # noqa: F401  (first: before anything can import DeepSpeed)
from .config import OnPolicyConfig, PPOConfig
from .models import create_reference_model
from .script_args import (
    SIMPLE_CHAT_TEMPLATE,
    ModelConfig,
    ScriptArguments,
    get_kbit_device_map,
    get_peft_config,
    get_quantization_config,
)
from .trainer import PPOTrainer
from .value_head import AutoModelForCausalLMWithValueHead

__version__ = "0.1.0"

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "SIMPLE_CHAT_TEMPLATE",
    "ModelConfig",
    "OnPolicyConfig",
    "PPOConfig",
    "PPOTrainer",
    "ScriptArguments",
    "create_reference_model",
    "get_kbit_device_map",
    "get_peft_config",
    "get_quantization_config",
]
