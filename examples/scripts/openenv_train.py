"""PPO on an OpenEnv environment behind a server: one of the two shipped with trl_ppo, served here by a process of
its own, or any OpenEnv server given by its URL (`pip install 'trl_ppo[openenv]'`).

    python examples/scripts/openenv_train.py --env arithmetic --model .cache/smollm2-135m-instruct
    python examples/scripts/openenv_train.py --env guess --model .cache/smollm2-135m-instruct
    python examples/scripts/openenv_train.py --url http://my-env-host:8000 --model ... --column target=1,2,3
    python examples/scripts/openenv_train.py --env guess --tiny --updates 1     # offline, a tiny random model

`--env guess`: `GuessEnvironment`, a number from 1 to 8 in 3 guesses (1.0 when found, -0.1 a wrong guess);
`--env arithmetic`: `ArithmeticEnvironment`, "What is (a * b) + c?" with MCP tools `multiply`, `add` and `answer`
(1.0 for the right answer). Each episode plays in a WebSocket session of its own; the rewards arrive per turn. The
model is a Hugging Face folder (SmolLM2: `python examples/scripts/get_smollm2.py .cache/smollm2-135m-instruct`),
given the ChatML tool template shipped with trl_ppo unless `--tool_chat_template none`; the critic is a value head
on the policy's backbone, starting at zero. On `--env arithmetic` a chat model first gets a short SFT start
(`--sft_steps`, cached in `--output_dir`): SmolLM2 does not call `answer` by itself. The start and the settings are
those of `benchmark/agents/openenv_learn.py --model`, which measures what RL adds (benchmark/RESULTS.md).
`--tiny` takes a random 2-layer model and a byte-level tool tokenizer instead, to see the whole path run offline in
seconds (it does not learn: it cannot write a tool call yet; a tiny model that learns both environments in about a
CPU-minute, from a short SFT start in a compact chat format, is `benchmark/agents/openenv_learn.py`). The episodes'
mean reward (`env/turn_rewards_mean`: what the server paid along the way) is printed at the first and the last
update.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmark", "agents"))  # openenv_learn
PROMPTS = {
    "guess": "Find my number from 1 to 8: call `guess` with a number, read the answer, and guess again.",
    "arithmetic": "Use the tools to compute it, then call `answer` with the result.",
}


def rows(args) -> dict:
    """The prompts, and the columns each episode's `reset` gets."""
    draw = random.Random(args.seed)
    prompts = [[{"role": "user", "content": PROMPTS.get(args.env, args.prompt)}]] * args.episodes
    if args.env == "guess":
        return {"prompt": prompts, "target": [draw.randint(1, 8) for _ in prompts]}
    if args.env == "arithmetic":  # "(a * b) + c" with one-digit numbers, as openenv_learn's problems
        lows = {"a": 2, "b": 2, "c": 1}
        return {"prompt": prompts, **{k: [draw.randint(low, 9) for _ in prompts] for k, low in lows.items()}}
    columns = dict(column.split("=", 1) for column in args.column)
    return {"prompt": prompts, **{name: [values.split(",")[i % len(values.split(","))] for i in range(len(prompts))]
                                  for name, values in columns.items()}}  # fmt: skip


def models(args, url: str):
    """(tokenizer, policy) of `--model` (after its SFT start, with `--sft_steps`), or the tiny offline pair of
    `--tiny`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if not args.tiny:
        folder = sft_start(args, url) if args.sft_steps else args.model
        return AutoTokenizer.from_pretrained(args.model, padding_side="left"), \
            AutoModelForCausalLM.from_pretrained(folder)
    from trl_ppo.agents.tiny_chat import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(args.seed)
    return tokenizer, AutoModelForCausalLM.from_config(config)


def sft_start(args, url: str) -> str:
    """The chat model fine-tuned on demonstrations of the arithmetic tools (half of them answering at once with a
    guess, so that RL has the tools' use to learn): openenv_learn's start, cached in `--output_dir` -> its folder."""
    import openenv_learn as learn

    from trl_ppo.agents.openenv_adapter import openenv_environment
    from trl_ppo.agents.tools import schemas, toolbox

    env = learn.chat_model_env(learn.environments()["arithmetic"])
    settings = learn.SFTSettings(**{**env.sft, "steps": args.sft_steps})
    tools = schemas(toolbox([], openenv_environment(url)()))  # the server's tools, as the trainer offers them
    folder, _, _ = learn.train_sft(env, learn.chat_tokenizer(args.model), tools, settings, args.output_dir,
                                   base=args.model)
    return folder


def train(args, url: str) -> None:
    from datasets import Dataset

    from trl_ppo import PPOConfig, PPOTrainer
    from trl_ppo.agents.openenv_adapter import openenv_environment

    tokenizer, policy = models(args, url)
    template = None if args.tiny or args.tool_chat_template == "none" else args.tool_chat_template
    micro_batch = min(2, args.batch_size)  # the update in passes of 2 episodes: the same update, less memory
    config = PPOConfig(output_dir=args.output_dir, per_device_train_batch_size=micro_batch,
                       gradient_accumulation_steps=args.batch_size // micro_batch,
                       total_episodes=args.batch_size * args.updates, local_rollout_forward_batch_size=args.batch_size,
                       learning_rate=args.learning_rate, lr_scheduler_type="constant", temperature=1.0,
                       response_length=args.response_length, max_turns=args.max_turns, max_tool_response_length=8,
                       stop_token="eos", tool_chat_template=template, num_ppo_epochs=1, num_mini_batches=1,
                       gae_level="turn", lam=1.0, logging_steps=1, num_sample_generations=0, save_strategy="no",
                       report_to="none", seed=args.seed)  # fmt: skip
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None, reward_model=[],
                         value_model=None, train_dataset=Dataset.from_dict(rows(args)),
                         environment_factory=openenv_environment(url))  # fmt: skip
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "env/turn_rewards_mean" in entry]
    turns = [entry["env/turn_rewards_mean"] for entry in logged]
    print(f"Mean reward per episode (the server's): {turns[0]:.3f} at update 1, {turns[-1]:.3f} at update "
          f"{len(turns)}; tool calls per episode {logged[-1]['env/tool_calls_mean']:.2f}, tool errors "
          f"{logged[-1]['env/tool_errors']:.0f}.")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=("guess", "arithmetic"), default="guess")
    parser.add_argument("--url", help="an OpenEnv server already running (instead of --env)")
    parser.add_argument("--prompt", default="Play.", help="with --url: the user message of every episode")
    parser.add_argument("--column", action="append", default=[], help="with --url: NAME=v1,v2,... for `reset`")
    parser.add_argument("--model", default=".cache/smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, offline (the path, not learning)")
    parser.add_argument("--tool_chat_template", default="chatml")
    parser.add_argument("--sft_steps", type=int, help="arithmetic with a chat model: SFT steps of its start (default "
                        "16; 0: none); other environments: none")
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--max_turns", type=int, default=4)
    parser.add_argument("--response_length", type=int, default=192)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="runs/openenv_train")
    args = parser.parse_args(argv)
    if args.sft_steps is None:
        args.sft_steps = 16 if args.env == "arithmetic" and not (args.tiny or args.url) else 0
    if args.sft_steps and (args.tiny or args.url or args.env != "arithmetic"):
        parser.error("--sft_steps: the start is written for --env arithmetic with a chat model (--model)")
    if args.batch_size % min(2, args.batch_size):
        parser.error("--batch_size: an even number (the update runs in passes of 2 episodes)")
    if args.url:
        args.env = "url"
        return train(args, args.url)
    from trl_ppo.agents import openenv_envs
    from trl_ppo.agents.openenv_server import OpenEnvServer

    classes = {"guess": (openenv_envs.GuessEnvironment, openenv_envs.GuessAction, openenv_envs.GuessObservation),
               "arithmetic": (openenv_envs.ArithmeticEnvironment,)}[args.env]  # fmt: skip
    with OpenEnvServer(*classes, max_concurrent_envs=max(64, 2 * args.batch_size)) as server:
        train(args, server.url)


if __name__ == "__main__":
    main()
