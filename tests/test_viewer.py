"""`trl-ppo trajectories view` (issue 45): a `trajectory_dir` as one self-contained HTML page, its numbers checked
here and its drawing checked in a real browser (headless Chromium) where one is installed."""

import html
import json
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from trl_ppo import ppo, trajectories, viewer
from trl_ppo.agents.tiny_chat import build_tool_tokenizer
from trl_ppo.cli import main
from trl_ppo.default_job import build_word_tokenizer
from trl_ppo.rollout import Rollout
from trl_ppo.statistics import explained_variance

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium to open the page in (`apt-get install -y chromium`; .ci/run installs it)"
)
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call><|im_end|>'
ANSWER = "\n<|im_start|>tool\n<tool_response>{}</tool_response><|im_end|>\n<|im_start|>assistant\n"
# The prompt holds markup that would end the page's script, or add an element, if it were not kept as text.
PROMPT = "What is 6 times 7? </script><b id=injected>x</b>"
# Episodes of a calculator agent: (segments, score, truncated, tool calls, tool errors).
AGENT_EPISODES = [
    ([("model", CALL), ("tool", ANSWER.format(42)), ("model", "It is 42.<|im_end|>")], 1.0, False, 1, 0),
    ([("model", "It is 41.<|im_end|>")], -0.5, False, 0, 0),
    ([("model", CALL), ("tool", ANSWER.format("error: no tool named divide")), ("model", CALL),
      ("tool", ANSWER.format("error: a timeout")), ("model", "I")], 0.25, True, 2, 1),
    ([("model", "Seven.<|im_end|>")], 0.5, False, 0, 0),
]  # fmt: skip
ONE_TURN_EPISODES = [([("model", text)], score, False, None, None) for text, score in
                     (("the movie was great", 0.8), ("so dull", -0.6), ("it felt wonderful today", 1.0))]  # fmt: skip
SETTINGS = dict(gamma=1.0, lam=0.95, lam_value=None, length_adaptive_lam_alpha=None, gae_level="turn", cliprange=0.2,
                cliprange_value=0.2, loss_agg_mode="token-mean", truncated_episodes="terminal")


def rollout_of(episodes, tokenizer, turn_reward: float = 0.0) -> Rollout:
    """A rollout of scripted episodes, with random log-probs and values; the first turn of the first episode gets
    `turn_reward`."""
    torch.manual_seed(0)
    encoded = [[(role, tokenizer.encode(text, add_special_tokens=False)) for role, text in e[0]] for e in episodes]
    width = max(sum(len(ids) for _, ids in segments) for segments in encoded)
    responses = torch.zeros(len(episodes), width, dtype=torch.long)
    mask, attended = torch.zeros_like(responses, dtype=torch.bool), torch.zeros_like(responses, dtype=torch.bool)
    for row, segments in enumerate(encoded):
        ids = [token for _, part in segments for token in part]
        responses[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = torch.tensor([role == "model" for role, part in segments for _ in part])
        attended[row, : len(ids)] = True
    query = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False)] * len(episodes))
    turn_rewards = None
    if any(e[3] is not None for e in episodes):  # an agent run: one reward slot per turn
        turn_rewards = torch.zeros(len(episodes), 3)
        turn_rewards[0, 0] = turn_reward
    return Rollout(query, torch.ones_like(query, dtype=torch.bool), responses, mask, logprobs=-torch.rand(mask.shape),
                   ref_logprobs=-torch.rand(mask.shape), values=torch.randn(mask.shape) * mask,
                   scores=torch.tensor([e[1] for e in episodes]), response_attention_mask=attended,
                   turn_rewards=turn_rewards, truncated=torch.tensor([e[2] for e in episodes]))  # fmt: skip


def write_run(folder, episodes, tokenizer, updates=(1, 2), rank=0):
    """Append the episodes' records to `folder`'s file of `rank`, once per update, as a run with
    `trajectory_dir` does. -> the rollout, its advantages and the records of the last update."""
    rollout = rollout_of(episodes, tokenizer, turn_reward=0.5)
    kl = (rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask
    rewards = ppo.kl_shaped_rewards(rollout.scores, kl, rollout.response_mask, 0.05, turn_rewards=rollout.turn_rewards)
    advantages = ppo.advantages_and_returns(rewards.rewards, rollout.values, rollout.response_mask, 1.0, 0.95,
                                            level="turn")  # fmt: skip
    played = None
    if episodes[0][3] is not None:
        played = [SimpleNamespace(tool_calls=e[3], tool_errors=e[4]) for e in episodes]
    for update in updates:
        records = trajectories.episode_records(update, rank, rollout, rewards, advantages, SimpleNamespace(**SETTINGS),
                                               tokenizer, played)  # fmt: skip
        trajectories.write_update(str(folder), rank, records)
    return rollout, advantages, records


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


def test_the_page_summarises_every_update_and_samples_beyond_its_limit(tmp_path, tool_tokenizer):
    rollout, advantages, records = write_run(tmp_path, AGENT_EPISODES, tool_tokenizer)
    write_run(tmp_path, AGENT_EPISODES, tool_tokenizer, updates=(1,), rank=1)  # a second process, update 1 only
    files = viewer.trajectory_files(str(tmp_path))
    data = viewer.page_data("run", files, limit=100)
    assert [(u["update"], u["episodes"], u["shown"]) for u in data["updates"]] == [(1, 8, 8), (2, 4, 4)]
    first = data["updates"][0]
    assert first["score"] == pytest.approx(0.3125)  # (1 - .5 + .25 + .5) / 4
    mask = rollout.response_mask
    expected_ev = explained_variance(rollout.values, advantages.returns, mask).item()
    assert first["explained_variance"] == pytest.approx(expected_ev, rel=1e-3)
    expected_kl = ((rollout.logprobs - rollout.ref_logprobs) * mask).sum(1).mean().item()
    assert first["kl"] == pytest.approx(expected_kl, rel=1e-3)
    episode = data["episodes"][2]  # rank 0's third episode of update 1
    assert "".join(episode["tokens"]) == tool_tokenizer.decode(records[2]["response_ids"])
    assert (episode["turns"], episode["tool_calls"], episode["tool_errors"], episode["truncated"]) == (3, 2, 1, True)
    assert episode["quantities"]["value error"][0] == pytest.approx(records[2]["values"][0] - records[2]["returns"][0],
                                                                    rel=1e-3)  # fmt: skip
    assert episode["quantities"]["KL"][-1] == pytest.approx(records[2]["logprobs"][-1] - records[2]["ref_logprobs"][-1],
                                                            rel=1e-3)  # fmt: skip
    # Beyond the limit: a sample, the same each time, in update order; the summaries still count every episode.
    sampled = viewer.page_data("run", files, limit=5)
    assert len(sampled["episodes"]) == 5 and sampled == viewer.page_data("run", files, limit=5)
    assert [e["update"] for e in sampled["episodes"]] == sorted(e["update"] for e in sampled["episodes"])
    assert [u["episodes"] for u in sampled["updates"]] == [8, 4] and sum(u["shown"] for u in sampled["updates"]) == 5
    page = viewer.render(sampled)
    assert "showing 5 of 12 episodes" in " ".join(page.split())
    # Self-contained: nothing to fetch, and no episode text can end the data block early.
    assert not re.search(r"\b(src|href)\s*=|url\(|@import", page)
    assert page.count("</script>") == 2 and "<b id=injected>" not in page


def test_bad_input_fails_before_any_work_with_a_clear_message(tmp_path, capsys):
    def fails(*argv, match):
        with pytest.raises(SystemExit, match=match):
            main(["trajectories", "view", *argv])

    fails(str(tmp_path / "missing"), match="missing is neither a trajectory file nor a folder of them")
    fails(str(tmp_path), match="holds no trajectory file")
    empty = tmp_path / "trajectories-0.jsonl"
    empty.write_text("")
    fails(str(tmp_path), match="no episodes in it")
    empty.write_text(json.dumps({"update": 1, "score": 1.0}) + "\n")
    fails(str(empty), match=r"line 1: not a trajectory record \(it has no response_ids, model_mask, ")
    empty.write_text("[1, 2]\n")
    fails(str(empty), match="line 1: not a trajectory record")
    fails(str(empty), "-o", str(tmp_path / "no" / "page.html"), match="its folder does not exist")
    fails(str(empty), "--max_episodes", "0", match="at least 1")


def test_the_command_writes_the_page_into_the_folder(tmp_path, tool_tokenizer, capsys):
    write_run(tmp_path, AGENT_EPISODES, tool_tokenizer)
    main(["trajectories", "view", str(tmp_path)])
    assert "2 updates, 8 of 8 episodes shown" in capsys.readouterr().out
    page = (tmp_path / "trajectories.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1))
    assert [u["update"] for u in data["updates"]] == [1, 2]
    main(["trajectories", "view", str(tmp_path / "trajectories-0.jsonl")])  # one file: the page beside it
    assert (tmp_path / "trajectories-0.html").is_file()


# What the browser does to the page, then writes into it as JSON for `--dump-dom`: the drawn episode, its colours by
# advantage and then by value (through the select, as a user would), and the table sorted by score (a header clicked
# once, then twice) and filtered to the truncated episodes.
DRIVER = """<script>
const result = {}, rows = () => [...document.querySelectorAll("#episodes tbody tr")];
const colours = () => [...document.querySelectorAll("#conversation .tok")].map(token => token.style.backgroundColor);
const scores = () => rows().map(row => Number(row.cells[1].textContent));
const set = (id, value, event) => { const node = document.getElementById(id); node.value = value;
                                    node.dispatchEvent(new Event(event)); };
result.rows = rows().length;
result.tokens = document.querySelectorAll("#conversation .tok").length;
result.turns = document.querySelectorAll("#conversation .turn").length;
result.tools = [...document.querySelectorAll("#conversation .tool")].map(tool => tool.textContent);
result.rewards = [...document.querySelectorAll("#conversation .reward")].map(badge => badge.textContent);
result.title = document.querySelector("#conversation .tok").title;
result.injected = document.getElementById("injected") !== null;
result.prompt = document.querySelector("#conversation details pre").textContent;
result.advantage = colours();
set("colour", "value", "change");
result.value = colours();
result.valueTitle = document.querySelector("#conversation .tok").title;
result.unsorted = scores();
document.querySelector('#episodes th[data-key="score"]').click();
result.ascending = scores();
document.querySelector('#episodes th[data-key="score"]').click();
result.descending = scores();
set("f-truncated", "yes", "input");
result.truncated = rows().map(row => row.cells[4].textContent);
document.body.append(Object.assign(document.createElement("pre"), {id: "result", textContent: JSON.stringify(result)}));
</script>
</body>"""


def drive_in_chromium(page_path, tmp_path) -> dict:
    """Open a copy of the page with `DRIVER` added in headless Chromium -> what the driver saw."""
    driven = tmp_path / "driven.html"
    driven.write_text(page_path.read_text().replace("</body>", DRIVER))
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
               "--dump-dom", driven.as_uri()]  # fmt: skip
    dom = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.S)
    assert found, f"the page's script did not run to the end; Chromium gave:\n{dom[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def hue(colour: str) -> int:
    """1 for a green CSS `rgb(...)`, -1 for a red one, 0 for white or grey."""
    red, green, _ = map(int, re.findall(r"\d+", colour))
    return (green > red) - (red > green)


@needs_chromium
@pytest.mark.parametrize("run", ["agent", "one turn"])
def test_a_browser_draws_colours_and_sorts_the_episodes(run, tmp_path, tool_tokenizer):
    episodes, tokenizer = (AGENT_EPISODES, tool_tokenizer) if run == "agent" else (ONE_TURN_EPISODES,
                                                                                  build_word_tokenizer())  # fmt: skip
    _, advantages, records = write_run(tmp_path / "run", episodes, tokenizer)
    main(["trajectories", "view", str(tmp_path / "run"), "-o", str(tmp_path / "page.html")])
    seen = drive_in_chromium(tmp_path / "page.html", tmp_path)
    first = records[0]  # drawn first: the table starts in episode order
    assert seen["rows"] == len(episodes)
    assert seen["tokens"] == sum(first["model_mask"]) and seen["turns"] == len(first["turn_starts"])
    assert f"score {first['score']:g}" in seen["rewards"]
    if run == "agent":
        assert seen["tools"] == ["tool answer (not trained on)" + ANSWER.format(42)]
        assert "turn reward 0.5" in seen["rewards"] and seen["prompt"] == PROMPT and not seen["injected"]
    assert seen["title"].startswith(f"advantage: {viewer.number(first['advantages'][0]):g}\n")
    # Each model token green where the chosen quantity is positive, red where negative: by advantage, then by value.
    model = [i for i, trained in enumerate(first["model_mask"]) if trained]
    for name, colours in (("advantages", seen["advantage"]), ("values", seen["value"])):
        assert [hue(colour) for colour in colours] == [(first[name][i] > 0) - (first[name][i] < 0) for i in model]
    assert seen["value"] != seen["advantage"] and seen["valueTitle"].startswith("value: ")
    scores = [e[1] for e in episodes]
    assert seen["unsorted"] == scores and scores != sorted(scores)
    assert seen["ascending"] == sorted(scores) and seen["descending"] == sorted(scores, reverse=True)
    assert seen["truncated"] == ["yes"] * sum(e[2] for e in episodes)


def test_a_critic_free_run_shows_no_critic_numbers(tmp_path, tool_tokenizer):
    """A critic-free `advantage_estimator` writes null `values` and `returns`: the page has no explained variance
    and offers no value, return or value error to colour by."""
    rollout = rollout_of(AGENT_EPISODES, tool_tokenizer)
    rollout.values = None
    kl = (rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask
    rewards = ppo.kl_shaped_rewards(rollout.scores, kl, rollout.response_mask, 0.05, turn_rewards=rollout.turn_rewards)
    advantages = ppo.Advantages(torch.randn(rollout.response_mask.shape) * rollout.response_mask, None)
    settings = SimpleNamespace(**SETTINGS, advantage_estimator="grpo", num_generations=2, scale_rewards="group")
    records = trajectories.episode_records(1, 0, rollout, rewards, advantages, settings, tool_tokenizer)
    assert records[0]["values"] is None and records[0]["returns"] is None
    trajectories.write_update(str(tmp_path), 0, records)
    data = viewer.page_data("run", viewer.trajectory_files(str(tmp_path)), limit=100)
    assert data["updates"][0]["explained_variance"] is None
    assert list(data["episodes"][0]["quantities"]) == ["advantage", "KL", "reward"]
    assert "showing 4 of 4 episodes" in " ".join(viewer.render(data).split())
