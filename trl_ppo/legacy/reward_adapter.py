"""trl 0.11's multi-adapter RL: a reward model kept as a second PEFT adapter on the policy's own backbone (with its
`score` head), so that scoring needs no second copy of the model.

`AutoModelForCausalLMWithValueHead.from_pretrained(..., peft_config=..., reward_adapter=folder)` loads the adapter
(`load_reward_adapter`); `model.compute_reward_score(input_ids, attention_mask)` scores with it switched on
(`reward_scores`). The folder is what `peft` saves for a sequence-classification model trained with a LoRA
adapter (`task_type="SEQ_CLS"`): the adapter's weights with the `score` head among them.
"""

from __future__ import annotations

import os

import torch
from torch import nn

_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
SCORE_MODULE = "score"  # the head's name in sequence-classification models (trl 0.11 looked for this one only)


def load_reward_adapter(lm: nn.Module, source: str, adapter_name: str) -> nn.Linear:
    """Load the reward adapter `source` (a folder or a hub id) into the PEFT model `lm` as `adapter_name`, frozen
    and not active -> its score head as a frozen `nn.Linear` on `lm`'s device and dtype."""
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"`reward_adapter` must be the folder or hub id of a reward adapter, got {type(source).__name__}."
        )
    weights = _adapter_weights(str(source))
    head = {key.rsplit(".", 1)[-1]: value for key, value in weights.items() if SCORE_MODULE in key.split(".")}
    if "weight" not in head:
        raise ValueError(
            f"`reward_adapter` {source} has no `{SCORE_MODULE}` head among its weights: save the adapter of a "
            "sequence-classification reward model (PEFT `task_type='SEQ_CLS'`), whose head is saved with it."
        )
    lm.load_adapter(str(source), adapter_name, is_trainable=False)
    parameter = next(lm.parameters())
    num_labels, hidden_size = head["weight"].shape
    score = nn.Linear(hidden_size, num_labels, bias="bias" in head)
    score.load_state_dict(head)
    return score.to(device=parameter.device, dtype=parameter.dtype).requires_grad_(False)


def _adapter_weights(source: str) -> dict[str, torch.Tensor]:
    """The tensors of the adapter's weights file (safetensors or torch), local or from the hub."""
    from safetensors.torch import load_file

    for name in _WEIGHT_FILES:
        path = os.path.join(source, name)
        if not os.path.isdir(source):
            path = _hub_file(source, name)
        if path is not None and os.path.isfile(path):
            if name.endswith(".safetensors"):
                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(
        f"`reward_adapter` {source} holds no adapter weights ({' or '.join(_WEIGHT_FILES)}): pass the folder that "
        "`save_pretrained` of the PEFT reward model wrote."
    )


def _hub_file(repo_id: str, name: str) -> str | None:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, name)
    except Exception:  # absent, offline or no access: the caller says what is missing
        return None


@torch.no_grad()
def reward_scores(lm: nn.Module, score: nn.Linear, reward_adapter: str, policy_adapter: str, inputs: dict):
    """Scores `[B, L, num_labels]` of every position of `inputs` (the LM's forward kwargs), read by `score` from
    the final hidden states with the reward adapter active; the policy's adapter is active again afterwards, and
    the training mode is restored (dropout is off while scoring)."""
    was_training = lm.training
    # No `inference_mode=True` (PEFT >= 0.19 only): under no_grad the adapter's trainability does not matter, and
    # switching back to the policy's adapter below freezes every other adapter again.
    lm.set_adapter(reward_adapter)
    lm.eval()
    try:
        output = lm(**inputs, output_hidden_states=True, return_dict=True)
        hidden = output.hidden_states[-1]
        return score(hidden.to(device=score.weight.device, dtype=score.weight.dtype))
    finally:
        lm.set_adapter(policy_adapter)
        lm.train(was_training)
