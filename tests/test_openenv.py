"""Environments behind a server (issue 56): the shipped OpenEnv environments served by real server processes
(uvicorn, on a free port of 127.0.0.1, started by `OpenEnvServer`), trained through over WebSocket sessions, and the
episodes checked against each environment's own record of what it was sent; a server killed mid-run, a server at
capacity, a slow server, a step past `tool_timeout`, and no session left open after `train()`.

The model's turns are scripted (the tiny random policy cannot write a tool call yet); their log-probs, the update and
everything between the sampler and the server are the real ones."""

import json
import os
import re
import time

import pytest
from conftest import load_example_script, needs_tool_parsing
from datasets import Dataset
from test_agent_training import tool_policy
from transformers import TrainerCallback

from trl_ppo import PPOTrainer
from trl_ppo.agents import runner
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.checkpoint.folders import checkpoint_folders
from trl_ppo.checkpoint.manifest import checkpoint_problem
from trl_ppo.deadlines import UserCallError

openenv = pytest.importorskip("openenv")  # the `openenv` extra (in `dev`): without it, nothing here can run

from trl_ppo.agents.openenv_adapter import ServerAtCapacityError, openenv_environment, render  # noqa: E402
from trl_ppo.agents.openenv_envs import GuessAction, GuessObservation  # noqa: E402
from trl_ppo.agents.openenv_server import OpenEnvServer, object_path  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
TARGETS = [4, 2, 6, 1, 3, 5, 7, 8]  # binary search from 4 finds all but 8 in 3 guesses


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_tokenizer()


def serve(tmp_path_factory, environment: str, **settings) -> tuple[OpenEnvServer, str]:
    """A server process of `openenv_test_envs.<environment>` -> (the server, the file of its record)."""
    import openenv_test_envs

    record = str(tmp_path_factory.mktemp("record") / "record.jsonl")
    cls = getattr(openenv_test_envs, environment)
    classes = (GuessAction, GuessObservation) if "Guess" in environment else ()
    env = {"OPENENV_RECORD": record, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    return OpenEnvServer(cls, *classes, env=env, **settings), record


@pytest.fixture(scope="module")
def guess_server(tmp_path_factory):
    server, record = serve(tmp_path_factory, "RecordedGuess", max_concurrent_envs=16)
    yield server, record
    server.stop()


def read_record(path: str, kind: str) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [entry for entry in map(json.loads, file) if entry["kind"] == kind]


def clear_record(path: str) -> None:
    open(path, "w").close()


def scripted(tokenizer, next_turn):
    """`runner.turn_sampler` replaced: each turn is `next_turn(the context's text)`, as ids."""

    def make(models, sampling):
        def sample_turn(contexts, max_new_tokens):
            texts = [next_turn(tokenizer.decode(context)) for context in contexts]
            return [tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens] for text in texts]

        return sample_turn

    return make


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call><|im_end|>'


# the benchmark's scripted model, which halves the range 1..8 with each answer read so far
binary_search = load_example_script("openenv_speed", folder=os.path.join("benchmark", "agents")).binary_search


class Collected:
    """Every episode the runner plays, over all updates (it keeps only the latest rollout's)."""

    def __init__(self, monkeypatch):
        self.episodes = []
        collect = runner.AgentRunner.collect

        def collecting(agents, *args, **kwargs):
            rollout = collect(agents, *args, **kwargs)
            self.episodes += agents.episodes
            return rollout

        monkeypatch.setattr(runner.AgentRunner, "collect", collecting)


def trainer_on(factory, tokenizer, make_config, rows: dict, **overrides) -> PPOTrainer:
    settings = dict(max_turns=4, response_length=500, total_episodes=len(rows["prompt"]), stop_token="eos",
                    num_ppo_epochs=1, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    local_rollout_forward_batch_size=4)  # fmt: skip
    return PPOTrainer(args=make_config(**{**settings, **overrides}), processing_class=tokenizer,
                      model=tool_policy(tokenizer), ref_model=None, reward_model=[], value_model=None,
                      train_dataset=Dataset.from_dict(rows), environment_factory=factory)  # fmt: skip


def guess_rows(targets, **columns) -> dict:
    return {"prompt": [[{"role": "user", "content": "Play."}]] * len(targets), "target": list(targets),
            **{name: [value] * len(targets) for name, value in columns.items()}}  # fmt: skip


@pytest.mark.slow  # a server process starts in about 4 s: `make test` runs these, the quick loop does not
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_a_typed_environment_trains_through_a_real_server(guess_server, tokenizer, make_config, monkeypatch):
    server, record = guess_server
    clear_record(record)
    monkeypatch.setattr(runner, "turn_sampler", scripted(tokenizer, binary_search))
    monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    collected = Collected(monkeypatch)
    factory = openenv_environment(server)  # the URL is read from it
    assert factory.guess.tool_schema["function"]["parameters"]["properties"]["number"]["maximum"] == 8  # /schema's
    trainer = trainer_on(factory, tokenizer, make_config, guess_rows(TARGETS))
    trainer.train()
    assert trainer.state.global_step == 2 and server.sessions() == {"active": 0, "max": 16}
    played = sorted((e.environment.state["target"], e.environment.state["guesses"], e.turn_rewards)
                    for e in collected.episodes)  # fmt: skip
    sent = sorted((entry["target"], entry["guesses"], entry["rewards"]) for entry in read_record(record, "guess"))
    assert played == sent and len(sent) == 8
    by_target = {target: (guesses, rewards) for target, guesses, rewards in played}
    assert by_target[6] == ([4, 6], [-0.1, 1.0])  # the turn that found it is paid; the game then ends
    assert by_target[8] == ([4, 6, 7], [-0.1, -0.1, -0.1])  # ended by its 3 guesses, not by the model
    assert all(not e.truncated and e.environment.done for e in collected.episodes)
    assert all(e.environment.rewards == e.turn_rewards for e in collected.episodes)  # what reward functions read
    logged = [entry["env/turn_rewards_mean"] for entry in trainer.state.log_history if "env/turn_rewards_mean" in entry]
    assert sum(logged) * 4 == pytest.approx(sum(sum(rewards) for *_, rewards in played))  # 4 episodes an update


def arithmetic_turn(text: str) -> str:
    """multiply(a, b), then add(product, c), then answer(sum), reading the tools' answers."""
    a, b, c = map(int, re.search(r"What is \((\d+) \* (\d+)\) \+ (\d+)\?", text).groups())
    answers = [int(n) for n in re.findall(r"<tool_response>\n(-?\d+)\n", text)]
    turns = [call("multiply", a=a, b=b), call("add", a=answers[0] if answers else 0, b=c),
             call("answer", value=answers[-1] if answers else 0)]  # fmt: skip
    return turns[min(len(answers), 2)]


@pytest.mark.slow  # a server of its own: about 6 s
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_an_mcp_environment_offers_the_servers_tools_and_scores_the_answer(tmp_path_factory, tokenizer, make_config,
                                                                            monkeypatch):  # fmt: skip
    server, record = serve(tmp_path_factory, "RecordedArithmetic", max_concurrent_envs=8)
    with server:
        factory = openenv_environment(server.url)
        schema = factory.multiply.tool_schema["function"]
        assert schema["description"] == "Multiply two integers."  # listed by the server, not written here
        assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor."}
        monkeypatch.setattr(runner, "turn_sampler", scripted(tokenizer, arithmetic_turn))
        monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
        collected = Collected(monkeypatch)
        rows = {"prompt": [[{"role": "user", "content": "Compute it."}]] * 4, "a": [3, 4, 5, 6], "b": [7, 8, 9, 2],
                "c": [1, 2, 3, 4]}  # fmt: skip
        trainer_on(factory, tokenizer, make_config, rows).train()
        assert server.sessions()["active"] == 0
    calls = read_record(record, "call")
    assert sorted((tuple(e["problem"]), e["tool"], e["reward"]) for e in calls) == sorted(
        (problem, tool, 1.0 if tool == "answer" else 0.0)
        for problem in [(3, 7, 1), (4, 8, 2), (5, 9, 3), (6, 2, 4)] for tool in ("multiply", "add", "answer"))
    assert all(e.turn_rewards == [0.0, 0.0, 1.0] and e.environment.done for e in collected.episodes)


@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_a_reset_that_fails_closes_the_environments_already_made(make_config, tokenizer):
    """The batch's third `reset` raises: the two environments made before it are closed (their sessions, sandboxes
    or files released), not left open."""
    closed = []

    class Flaky:
        made, number = 0, 0  # the probe instance the trainer makes to list tools is never reset: number 0

        def reset(self, **row):
            Flaky.made += 1
            self.number = Flaky.made
            if self.number == 3:
                raise ValueError("no third episode")

        def close(self):
            closed.append(self.number)

        def look(self) -> str:
            """Look around."""
            return "nothing"

        def get_reward(self) -> float:
            return 0.0

    trainer = trainer_on(Flaky, tokenizer, make_config, guess_rows([1, 2, 3, 4]), max_turns=2)
    with pytest.raises(ValueError, match="no third episode"):
        trainer.train()
    assert closed == [0, 1, 2]  # the probe instance, at construction; then the two made before the failure


def test_observations_read_as_their_text_or_as_json():
    assert render({"feedback": "higher", "reward": -0.1, "done": False, "metadata": {}}) == "higher"
    assert render({"reward": None, "metadata": {"question": "What is 2?"}}) == "What is 2?"
    assert render({"board": [[0, 1]], "turn": "x", "metadata": {}}) == '{"board": [[0, 1]], "turn": "x"}'


def test_a_server_that_is_not_there_is_named():
    with pytest.raises(ConnectionError, match=r"No OpenEnv server answers at http://127\.0\.0\.1:9 \(.*\): start it"):
        openenv_environment("http://127.0.0.1:9")


def test_a_class_a_server_process_cannot_import_is_refused():
    class Local:
        pass

    with pytest.raises(ValueError, match="defined in a script or a function: a server process cannot import it"):
        object_path(Local)


class KillAfterFirstUpdate(TrainerCallback):
    def __init__(self, server):
        self.server = server

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.server.process.kill()
            self.server.process.wait()


@pytest.mark.slow
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_a_server_killed_mid_run_stops_the_run_naming_it(tmp_path_factory, tokenizer, make_config, monkeypatch):
    """The run stops with the error naming the server; the checkpoint of update 1 is intact, to resume from."""
    server, _ = serve(tmp_path_factory, "RecordedGuess", max_concurrent_envs=8)
    monkeypatch.setattr(runner, "turn_sampler", scripted(tokenizer, binary_search))
    monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    factory = openenv_environment(server)
    trainer = trainer_on(factory, tokenizer, make_config, guess_rows(TARGETS), save_strategy="steps", save_steps=1,
                         user_call_retries=1, user_call_backoff=0.01)  # fmt: skip
    trainer.add_callback(KillAfterFirstUpdate(server))
    with pytest.raises(UserCallError) as raised:
        trainer.train()
    message = str(raised.value)
    assert message.startswith("`OpenEnvEpisode.reset` raised ConnectionError: the OpenEnv server at "
                              f"{server.url} failed at `reset`"), message
    assert "on each of its 2 tries" in message and "resume from it" in message
    assert trainer.state.global_step == 1
    [checkpoint] = checkpoint_folders(trainer.args.output_dir)
    assert checkpoint.endswith("checkpoint-1") and checkpoint_problem(checkpoint) is None


@pytest.mark.slow
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_a_server_at_capacity_is_refused_naming_it_and_leaks_no_session(tmp_path_factory, tokenizer, make_config,
                                                                         monkeypatch):  # fmt: skip
    server, _ = serve(tmp_path_factory, "RecordedGuess", max_concurrent_envs=2)
    with server:
        monkeypatch.setattr(runner, "turn_sampler", scripted(tokenizer, binary_search))
        monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
        trainer = trainer_on(openenv_environment(server), tokenizer, make_config, guess_rows(TARGETS[:4]))
        with pytest.raises(ServerAtCapacityError, match=r"is at capacity .*2/2 sessions.*larger `max_concurrent_envs`"):
            trainer.train()
        assert server.sessions()["active"] == 0


@pytest.mark.slow
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_a_slow_server_trains_within_the_deadlines(guess_server, tokenizer, make_config, monkeypatch):
    """0.5 s a step: the episodes of a batch wait on the server side by side, and no deadline is met."""
    server, record = guess_server
    clear_record(record)
    monkeypatch.setattr(runner, "turn_sampler", scripted(tokenizer, binary_search))
    monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    collected = Collected(monkeypatch)
    trainer = trainer_on(openenv_environment(server), tokenizer, make_config, guess_rows(TARGETS[:4], delay=0.5),
                         total_episodes=4)  # fmt: skip
    trainer.train()
    assert sum(e.turns for e in collected.episodes) == 8  # 1 + 2 + 2 + 3 guesses
    spans = sorted(span for entry in read_record(record, "guess") for span in entry["spans"])
    assert len(spans) == 8 and all(end - start >= 0.5 for start, end in spans)
    # the first turn's 4 steps ran side by side on the server, not one after the other
    assert max(start for start, _ in spans[:4]) < min(end for _, end in spans[:4])
    logged = next(entry for entry in trainer.state.log_history if "env/tool_timeouts" in entry)
    assert logged["env/tool_timeouts"] == 0 and server.sessions()["active"] == 0


@pytest.mark.slow
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_a_step_past_tool_timeout_ends_the_episode_and_closes_its_session(guess_server, tokenizer, make_config,
                                                                          monkeypatch):  # fmt: skip
    server, _ = guess_server
    monkeypatch.setattr(runner, "turn_sampler", scripted(tokenizer, binary_search))
    monkeypatch.setattr(runner.AgentRunner, "_lockstep", True)  # the script is the lockstep loop's sampler
    collected = Collected(monkeypatch)
    trainer = trainer_on(openenv_environment(server), tokenizer, make_config, guess_rows(TARGETS[:4], delay=2.0),
                         total_episodes=4, tool_timeout=0.3)  # fmt: skip
    trainer.train()
    assert [e.turns for e in collected.episodes] == [1] * 4  # each ended by its first, timed-out step
    logged = next(entry for entry in trainer.state.log_history if "env/tool_timeouts" in entry)
    assert logged["env/tool_timeouts"] == 4
    time.sleep(2.5)  # the server finishes the steps it was running, then drops their sessions
    assert server.sessions()["active"] == 0


@pytest.mark.slow
@needs_tool_parsing  # the model's tool calls are parsed by transformers
def test_the_speed_benchmark_and_the_example_run(tmp_path):
    """benchmark/agents/openenv_speed.py in its smallest form (its three modes and the round trips), and
    examples/scripts/openenv_train.py on each shipped environment with the tiny model (the path, not learning)."""
    import subprocess
    import sys

    root = os.path.dirname(TESTS)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.join(root, "benchmark", "agents", "openenv_speed.py"), "--updates", "1",
               "--batch_size", "2", "--round_trips", "5", "--repeats", "1",
               "--output_dir", str(tmp_path / "speed")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"mode"')]
    assert [row["mode"] for row in rows] == ["in_process", "websocket", "websocket_delay"]
    assert [row["steps"] for row in rows] == [3, 3, 3]  # targets 4 and 2: 1 guess and 2, the same in every mode
    assert rows[1]["http_step_ms"] > 0 and rows[1]["websocket_step_ms"] > 0
    for game in ("guess", "arithmetic"):
        command = [sys.executable, os.path.join(root, "examples", "scripts", "openenv_train.py"), "--env", game,
                   "--tiny", "--updates", "1", "--batch_size", "2", "--output_dir", str(tmp_path / game)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Mean reward per episode (the server's): " in done.stdout


@pytest.mark.slow  # a server of its own
def test_a_server_that_logs_much_keeps_answering_and_keeps_its_log(tmp_path_factory):
    """Its output goes to a file (`log_path`): in a pipe nobody read it would block the server after 64 KiB."""
    from openenv.core import GenericEnvClient

    server, _ = serve(tmp_path_factory, "NoisyGuess")
    try:
        for _ in range(12):  # 12 x 16 KiB: three times a pipe's capacity
            with GenericEnvClient(base_url=server.url).sync() as client:
                client.reset()
        with open(server.log_path) as log:
            assert log.read().count("x" * 16384) == 12
    finally:
        server.stop()
