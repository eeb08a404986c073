"""The probe's environment and tool cases (`AGENTS`): the user code under test (`AGENT_CODE`), the driver that
trains on it in the case's subprocess (`run_agent`, reached as `probe.py --agent CASE OUTPUT_DIR`) and the cases."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from probe_cases import BACKOFF, CALL_BOUND, DEADLINE, LOOP_GRACE, NOTES, PYTHON, RETRIES, Case

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")  # the entry point, with --agent


# ----------------------------------------------------------------------------------------- environments and tools
AGENT_CODE = r'''
import asyncio, math, os, sys, threading, time

FOREVER = threading.Event()


def ok_tool(a: int) -> str:
    """Echo a number.

    Args:
        a: the number.
    """
    return str(a)


class Base:
    def reset(self, **row):
        return "Call the tool once."

    def get_reward(self):
        return 1.0


def tool_hangs(a: int) -> str:
    """Hang.

    Args:
        a: the number.
    """
    FOREVER.wait()


def tool_sleeps_past(a: int) -> str:
    """Sleep past the deadline.

    Args:
        a: the number.
    """
    time.sleep(4)
    return "late"


def tool_raises(a: int) -> str:
    """Raise.

    Args:
        a: the number.
    """
    raise RuntimeError("tool bug")


def tool_huge(a: int) -> str:
    """A huge answer.

    Args:
        a: the number.
    """
    return "x" * 20_000_000


def tool_object(a: int):
    """A non-string answer.

    Args:
        a: the number.
    """
    return object()


def tool_none(a: int):
    """Returns None.

    Args:
        a: the number.
    """
    return None


def tool_prints(a: int) -> str:
    """Print to stdout.

    Args:
        a: the number.
    """
    print("TOOL PRINTED", a)
    return str(a)


async def tool_async_blocks(a: int) -> str:
    """Block the event loop.

    Args:
        a: the number.
    """
    time.sleep(9)
    return "late"


def tool_exits(a: int) -> str:
    """Call sys.exit.

    Args:
        a: the number.
    """
    sys.exit(4)


def tool_keyboard_interrupt(a: int) -> str:
    """Raise KeyboardInterrupt.

    Args:
        a: the number.
    """
    raise KeyboardInterrupt


class env_init_raises(Base):
    def __init__(self):
        raise ValueError("env bug in __init__")


class env_init_hangs(Base):
    def __init__(self):
        FOREVER.wait()


class env_init_connection_error(Base):
    def __init__(self):
        raise ConnectionError("sandbox unreachable")


class env_reset_hangs(Base):
    def reset(self, **row):
        FOREVER.wait()


class env_reset_returns_int(Base):
    def reset(self, **row):
        return 42


class env_get_reward_hangs(Base):
    def get_reward(self):
        FOREVER.wait()


class env_get_reward_nan(Base):
    def get_reward(self):
        return math.nan


class env_get_reward_none(Base):
    def get_reward(self):
        return None


class env_close_hangs(Base):
    def close(self):
        FOREVER.wait()


class env_close_raises(Base):
    def close(self):
        raise OSError("close failed")


class env_async_reset_blocks(Base):
    async def reset(self, **row):
        time.sleep(3600)


class env_get_reward_exits(Base):
    def get_reward(self):
        os._exit(5)
'''


def run_agent(case: str, output_dir: str, user_code: str | None = None) -> None:
    """The agent driver (in the case's subprocess): a tiny tool run, 2 updates of 2 episodes, with the case's tool
    (`tool_*`) or environment (`env_*`); an exception ends the process with its one line, status 1. With
    `user_code` (defined beside `AGENT_CODE`): under the default deadlines, room for longer tool answers, and the
    first tool answer printed (`TOOL ANSWER: ...`), what the model read."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trl_ppo import PPOConfig, PPOTrainer
    from trl_ppo.agents import runner
    from trl_ppo.agents.tiny_chat import build_tool_tokenizer

    namespace: dict = {"__name__": "probe_agent"}
    exec(compile(AGENT_CODE + (user_code or ""), "probe_agent.py", "exec"), namespace)
    tokenizer = build_tool_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    tool = namespace[case] if case.startswith("tool_") else namespace["ok_tool"]
    environment = namespace[case] if case.startswith("env_") else namespace["Base"]
    name = tool.__name__
    call = f'<tool_call>{{"name": "{name}", "arguments": {{"a": 7}}}}</tool_call><|im_end|>'
    shown = user_code is None  # the first answer is printed for user code only

    def scripted(models, sampling):  # each episode: one call of the tool, then an answer
        def sample_turn(contexts, max_new_tokens):
            nonlocal shown
            turns = []
            for context in contexts:
                answered = "</tool_response>" in tokenizer.decode(context)
                if answered and not shown:
                    shown = True
                    answer = tokenizer.decode(context).rsplit("<tool_response>", 1)[-1].split("</tool_response>")[0]
                    print("TOOL ANSWER:", answer.strip().replace("\n", " "), flush=True)
                text = "Done.<|im_end|>" if answered else call
                turns.append(tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens])
            return turns

        return sample_turn

    runner.turn_sampler = scripted
    runner.AgentRunner._lockstep = True  # the script is the lockstep loop's sampler
    settings = dict(output_dir=output_dir, max_turns=2, response_length=200, total_episodes=4, stop_token="eos",
                    num_ppo_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    local_rollout_forward_batch_size=2, learning_rate=1e-3, num_sample_generations=0,
                    logging_steps=1, save_strategy="steps", save_steps=1, report_to="none", seed=3,
                    max_tool_response_length=64, tool_timeout=DEADLINE, environment_timeout=DEADLINE,
                    reward_timeout=DEADLINE, user_call_retries=RETRIES, user_call_backoff=BACKOFF)  # fmt: skip
    if user_code is not None:  # the default deadlines; room for an error message as the answer
        for name in ("tool_timeout", "environment_timeout", "reward_timeout", "user_call_retries", "user_call_backoff"):
            del settings[name]
        settings.update(max_tool_response_length=160, response_length=400)
    args = PPOConfig(**settings)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Echo {i}."}] for i in range(4)]})
    try:
        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=[],
                             train_dataset=dataset, value_model=None, tools=[tool],
                             environment_factory=environment)  # fmt: skip
        trainer.train()
        trainer.save_model(output_dir)
    except Exception as error:  # the Python API's message: the exception's one line, after its traceback
        sys.stdout.flush()
        traceback.print_exc()
        print(f"{type(error).__name__}: {error}".replace("\n", " "), file=sys.stderr)
        sys.exit(1)
    print(f"Saved the trained policy to {output_dir}")


def agent_case(name: str):
    def setup(folder: Path) -> dict:
        output = folder / "out"
        output.mkdir()
        (output / NOTES).write_text("mine\n")
        return {"command": [PYTHON, PROBE, "--agent", name, str(output)], "output_dir": output, "api": True}

    return setup


ENV_BOUND = CALL_BOUND * 2  # a probe environment made at construction, then the episodes'
AGENTS = [
    Case("tool_hangs", "tool", "tool_hangs", agent_case("tool_hangs"), bound=4 * DEADLINE,
         evidence=("env/tool_timeouts",)),
    Case("tool_sleeps_past_deadline", "tool", "tool_sleeps_past", agent_case("tool_sleeps_past"),
         bound=4 * DEADLINE, evidence=("env/tool_timeouts",)),
    Case("tool_raises", "tool", "tool_raises", agent_case("tool_raises"), evidence=("env/tool_errors",)),
    Case("tool_huge_answer", "tool", "tool_huge", agent_case("tool_huge"), evidence=("env/truncated_tool_responses",),
         note="20 MB answer, max_tool_response_length=64"),
    Case("tool_returns_object", "tool", "tool_object", agent_case("tool_object"), evidence=()),
    Case("tool_returns_none", "tool", "tool_none", agent_case("tool_none"), evidence=()),
    Case("tool_prints", "tool", "tool_prints", agent_case("tool_prints"), evidence=("TOOL PRINTED",),
         note="not a misbehaviour: the print must pass through"),
    Case("tool_async_blocks_loop", "tool", "tool_async_blocks", agent_case("tool_async_blocks"),
         bound=4 * (DEADLINE + LOOP_GRACE + 9), evidence=("env/tool_timeouts",)),
    Case("tool_sys_exit", "tool", "tool_exits", agent_case("tool_exits"), evidence=("env/tool_errors",)),
    Case("tool_keyboard_interrupt", "tool", "tool_keyboard_interrupt", agent_case("tool_keyboard_interrupt"),
         evidence=("env/tool_errors",)),
    Case("env_init_raises", "environment", "env_init_raises", agent_case("env_init_raises"), bug=True),
    Case("env_init_hangs", "environment", "env_init_hangs", agent_case("env_init_hangs"), bound=ENV_BOUND),
    Case("env_init_connection_error", "environment", "env_init_connection_error",
         agent_case("env_init_connection_error"), bound=ENV_BOUND),
    Case("env_reset_hangs", "environment", "env_reset_hangs", agent_case("env_reset_hangs"), bound=ENV_BOUND),
    Case("env_reset_returns_int", "environment", "env_reset_returns_int", agent_case("env_reset_returns_int")),
    Case("env_async_reset_blocks_loop", "environment", "env_async_reset_blocks",
         agent_case("env_async_reset_blocks"), bound=2 * (RETRIES + 1) * (DEADLINE + LOOP_GRACE) + BACKOFF),
    Case("env_get_reward_hangs", "environment", "env_get_reward_hangs", agent_case("env_get_reward_hangs"),
         bound=CALL_BOUND),
    Case("env_get_reward_nan", "environment", "env_get_reward_nan", agent_case("env_get_reward_nan")),
    Case("env_get_reward_none", "environment", "env_get_reward_none", agent_case("env_get_reward_none")),
    Case("env_close_hangs", "environment", "env_close_hangs", agent_case("env_close_hangs"), bound=3 * DEADLINE,
         evidence=("calls/timeouts", "env_close_hangs.close()")),
    Case("env_close_raises", "environment", "env_close_raises", agent_case("env_close_raises"),
         evidence=("env_close_raises.close()",)),
    Case("env_get_reward_os_exit", "environment", "env_get_reward_exits", agent_case("env_get_reward_exits"),
         note="os._exit cannot be caught by anyone: what is left on disk is what counts"),
]
