"""Episodes per second with an environment in this process, behind a local OpenEnv server over WebSocket, and behind
one that adds 0.1 s to every step; plus the round trip of one step over OpenEnv's HTTP route and over its WebSocket.

    OMP_NUM_THREADS=1 python benchmark/agents/openenv_speed.py --out benchmark/agents/openenv_speed.jsonl

The game is `trl_ppo.agents.openenv_envs.GuessEnvironment` (a number from 1 to 8 in 3 guesses), played by a
scripted model that halves the range with each answer (its turns are fixed; the tiny policy's log-probs, values,
update and everything between the sampler and the environment are real): 1 to 3 steps an episode, 2.25 on average
over the 8 targets. Each mode trains `--updates` updates of `--batch_size` episodes with `PPOTrainer(...,
environment_factory=...)` and times `train()` (wall seconds; episodes / wall seconds is the row's `episodes_per_s`),
`--repeats` times, after one untimed run that pays for the imports and the first passes.
`in_process`: the same `GuessEnvironment` class wrapped as a trl_ppo environment, no server; `websocket`: served by
`OpenEnvServer`, one session per episode (`openenv_adapter`); `websocket_delay`: the same with 0.1 s of sleep in
every step (a remote or slow environment). OpenEnv's HTTP routes make a new environment per request, so they cannot
hold an episode: for them only the round trip of one step (POST /step) is timed, beside one step over the WebSocket.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from rows import emit_row  # noqa: E402

from trl_ppo.agents.openenv_envs import GuessAction, GuessEnvironment, GuessObservation  # noqa: E402

TARGETS = [4, 2, 6, 1, 3, 5, 7, 8]


class DelayedGuess(GuessEnvironment):
    """`GuessEnvironment` whose every step takes 0.1 s more."""

    def step(self, action, timeout_s=None, **kwargs):
        time.sleep(0.1)
        return super().step(action, timeout_s=timeout_s, **kwargs)


class InProcessGuess:
    """The same game as a trl_ppo environment in this process (no server): `guess` steps it directly."""

    def reset(self, **row):
        self.game = GuessEnvironment()
        self.ended = False
        return self.game.reset(target=row["target"]).feedback

    def guess(self, number: int) -> tuple[str, float]:
        """Guess the hidden number.

        Args:
            number: the number guessed, from 1 to 8.
        """
        observation = self.game.step(GuessAction(number=number))
        self.ended = observation.done
        return observation.feedback, observation.reward

    @property
    def done(self) -> bool:
        return self.ended

    def get_reward(self) -> float:
        return 0.0


def binary_search(text: str) -> str:
    """The scripted model's next turn: halve the range 1..8 with each answer read so far (also the tests')."""
    low, high = 1, 8
    guesses = [int(n) for n in re.findall(r'"number": (\d+)', text)]
    for guess, feedback in zip(guesses, re.findall(r"<tool_response>\n(\w+)\n", text)):
        low, high = (guess + 1, high) if feedback == "higher" else (low, guess - 1) if feedback == "lower" else (0, 0)
    if low == 0:  # "correct": the game has ended, which ends the episode before this turn is asked for
        return "Found it.<|im_end|>"
    number = (low + high) // 2
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {number}}}}}</tool_call><|im_end|>'


def train(factory, args) -> tuple[float, int]:
    """Train on `factory` with the scripted model -> (wall seconds of `train()`, steps played)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trl_ppo import PPOConfig, PPOTrainer
    from trl_ppo.agents import runner
    from trl_ppo.agents.tiny_chat import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    played = []

    def scripted(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            texts = [binary_search(tokenizer.decode(context)) for context in contexts]
            played.extend(texts)
            return [tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens] for text in texts]

        return sample_turn

    runner.turn_sampler = scripted
    runner.AgentRunner._lockstep = True  # the script is the lockstep loop's sampler
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    episodes = args.updates * args.batch_size
    rows = {"prompt": [[{"role": "user", "content": "Play."}]] * episodes,
            "target": [TARGETS[i % len(TARGETS)] for i in range(episodes)]}  # fmt: skip
    settings = PPOConfig(output_dir=args.output_dir, max_turns=4, response_length=500, total_episodes=episodes,
                         stop_token="eos", num_ppo_epochs=1, per_device_train_batch_size=args.batch_size,
                         gradient_accumulation_steps=1, local_rollout_forward_batch_size=args.batch_size,
                         num_sample_generations=0, save_strategy="no", report_to="none", logging_steps=1,
                         disable_tqdm=True)  # fmt: skip
    trainer = PPOTrainer(args=settings, processing_class=tokenizer, model=AutoModelForCausalLM.from_config(config),
                         ref_model=None, reward_model=[], value_model=None, train_dataset=Dataset.from_dict(rows),
                         environment_factory=factory)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start, len(played)


def round_trips(url: str, count: int) -> dict:
    """Mean milliseconds of one step over POST /step (a new environment each) and over one WebSocket session."""
    from openenv.core import GenericEnvClient

    body = json.dumps({"action": {"number": 4}}).encode()
    start = time.perf_counter()
    for _ in range(count):
        request = urllib.request.Request(f"{url}/step", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request).read()  # noqa: S310 (our own local server)
    http = (time.perf_counter() - start) / count * 1000

    async def over_websocket() -> float:
        client = GenericEnvClient(base_url=url)
        try:
            await client.reset(target=8, max_guesses=count + 1)
            begin = time.perf_counter()
            for _ in range(count):
                await client.step({"number": 4})
            return (time.perf_counter() - begin) / count * 1000
        finally:
            await client.close()

    return {"http_step_ms": round(http, 3), "websocket_step_ms": round(asyncio.run(over_websocket()), 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--round_trips", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (a row each), after one "
                        "untimed warm-up run in this process")
    parser.add_argument("--output_dir", default="/tmp/openenv_speed")
    parser.add_argument("--out", help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    from trl_ppo.agents.openenv_adapter import openenv_environment
    from trl_ppo.agents.openenv_server import OpenEnvServer

    common = {"updates": args.updates, "batch_size": args.batch_size, "threads": os.environ.get("OMP_NUM_THREADS"),
              "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    train(InProcessGuess, args)  # warm-up: imports, the first trainer and its first passes
    for repeat in range(args.repeats):
        seconds, steps = train(InProcessGuess, args)
        emit_row({"mode": "in_process", "repeat": repeat, "seconds": round(seconds, 2), "steps": steps,
                  "episodes_per_s": round(args.updates * args.batch_size / seconds, 2), **common}, args.out)
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    import openenv_speed  # this script as a module, so that the server process imports its class by name

    for mode, cls in (("websocket", GuessEnvironment), ("websocket_delay", openenv_speed.DelayedGuess)):
        with OpenEnvServer(cls, GuessAction, GuessObservation, max_concurrent_envs=4 * args.batch_size,
                           env=env) as server:  # fmt: skip
            for repeat in range(args.repeats):
                seconds, steps = train(openenv_environment(server), args)
                row = {"mode": mode, "repeat": repeat, "seconds": round(seconds, 2), "steps": steps,
                       "episodes_per_s": round(args.updates * args.batch_size / seconds, 2), **common}
                if mode == "websocket" and repeat == 0:
                    row |= round_trips(server.url, args.round_trips)
                emit_row(row, args.out)

if __name__ == "__main__":
    main()
