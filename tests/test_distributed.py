"""Several processes on the CPU: DDP over gloo, DeepSpeed ZeRO-2/3 and FSDP2, each launched with `accelerate launch`
and the shipped configs in examples/accelerate_configs/, running tests/scripts/distributed_run.py. accelerate turns
FSDP on only on GPUs: the FSDP2 runs let it shard over gloo on the CPU (tests/scripts/fsdp2_on_cpu.py).

Run alone with `pytest -m distributed`; skip with `pytest -m "not distributed"`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# conftest.torch_extensions: one DeepSpeed op build for the whole session
pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("torch_extensions")]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "distributed_run.py"
CONFIGS = ROOT / "examples" / "accelerate_configs"
FSDP2_ON_CPU = ({"TRL_PPO_TEST_FSDP2_ON_CPU": "1"}, ["--ddp_backend", "gloo"])
FSDP2_FLAGS = ["--num_processes", "2", "--mixed_precision", "no"]  # the GPU config, on two CPU processes
LAUNCH = {  # how each layout is launched: accelerate config, extra environment, script flags, accelerate flags
    "ddp": ("multi_cpu.yaml", {"ACCELERATE_USE_CPU": "true"}, [], []),
    "zero2": ("deepspeed_zero2_cpu.yaml", {}, ["--ddp_backend", "gloo"], []),
    "zero3": ("deepspeed_zero3_cpu.yaml", {}, ["--ddp_backend", "gloo"], []),
    "fsdp2": ("fsdp2.yaml", *FSDP2_ON_CPU, FSDP2_FLAGS),  # checkpoints: SHARDED_STATE_DICT
    "fsdp2_full": ("fsdp2.yaml", *FSDP2_ON_CPU, [*FSDP2_FLAGS, "--fsdp_state_dict_type", "FULL_STATE_DICT"]),
}
# Two updates of a global batch of 16 (2 processes x 4 per device x 2 accumulation steps).
RUN_FLAGS = [
    "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "2",
    "--total_episodes", "32",
    "--response_length", "8",
    "--local_rollout_forward_batch_size", "4",
    "--num_ppo_epochs", "2",
    "--learning_rate", "1e-3",
    "--num_sample_generations", "0",
    "--logging_steps", "1",
    "--save_strategy", "no",
    "--report_to", "none",
    "--seed", "5",
    "--disable_tqdm", "true",
]  # fmt: skip
STOP_AT_EOS = ["--stop_token", "eos"]
# The launched processes' environment. A process that aborts prints every thread's Python stack (faulthandler), and
# DeepSpeed's calls of torch's deprecated collectives (a FutureWarning each, about 70 per run) no longer push
# the lines that matter out of the stderr a failing test shows.
LAUNCH_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONFAULTHANDLER": "1",
    "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(layout: str, report_dir: Path, *flags: str, accelerate_flags=(), timeout: int = 240) -> list[dict]:
    """Run the script in 2 processes with `layout` (a key of `LAUNCH`), or in 1 plain process ("single");
    -> each process's report (see distributed_run.py)."""
    env = dict(os.environ, **LAUNCH_ENV)
    script = [str(SCRIPT), "--report_dir", str(report_dir), "--output_dir", str(report_dir / "out"), *RUN_FLAGS, *flags]
    if layout == "single":
        command = [sys.executable, *script]
    else:
        config, extra_env, layout_flags, layout_accelerate_flags = LAUNCH[layout]
        env.update(extra_env)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
        command += ["--main_process_port", str(free_port()), *layout_accelerate_flags, *accelerate_flags]
        command += [*script, *layout_flags]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    reports = sorted(report_dir.glob("rank*.json"))
    return [json.loads(path.read_text()) for path in reports]


def weights(report_dir: Path, rank: int = 0) -> dict:
    return torch.load(report_dir / f"weights_rank{rank}.pt")


def initial_weights(report_dir: Path) -> dict:
    return torch.load(report_dir / "initial_weights.pt")


def max_difference(a: dict, b: dict, prefix: str) -> float:
    """The largest elementwise difference over the tensors named `prefix...` in both (a value-head policy's
    `policy.pretrained_model.x` is compared with a plain policy's `policy.x`)."""
    a = {k.replace("pretrained_model.", ""): v for k, v in a.items()}
    b = {k.replace("pretrained_model.", ""): v for k, v in b.items()}
    names = [k for k in a if k.startswith(prefix) and k in b]
    assert names, f"no tensors named {prefix}... in both"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in names)


def without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k != "eps"} for entry in history]


def check_ranks_agree(reports: list[dict], report_dir: Path) -> None:
    """Both processes logged the same gathered metrics and hold the same weights, and sampled with different seeds."""
    assert [r["world_size"] for r in reports] == [2, 2]
    assert without_timing(reports[0]["log_history"]) == without_timing(reports[1]["log_history"])
    assert reports[0]["seed"] != reports[1]["seed"]
    first, second = weights(report_dir, 0), weights(report_dir, 1)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path):
    # Near-greedy sampling (temperature 1e-6) makes the responses independent of how the batch is split, and SGD
    # keeps the gradient's scale visible. The value model's gradient is then the same mean over the 16 episodes in
    # both layouts, so its weights after the first update agree to float precision; objective/scores and the value
    # loss of that update agree too. (The policy's loss differs by design: advantages are whitened per process.)
    flags = ["--temperature", "1e-6", "--optim", "sgd", "--learning_rate", "0.05", "--num_ppo_epochs", "1"]
    flags += ["--total_episodes", "16"]  # and no stop token: every micro-batch has the same number of tokens
    two = launch("ddp", tmp_path / "ddp", *flags)
    one = launch("single", tmp_path / "one", *flags, "--per_device_train_batch_size", "8")
    check_ranks_agree(two, tmp_path / "ddp")
    assert one[0]["world_size"] == 1
    two_log, one_log = two[0]["log_history"][0], one[0]["log_history"][0]
    assert two_log["episode"] == one_log["episode"] == 16
    assert two_log["objective/scores"] == pytest.approx(one_log["objective/scores"], abs=1e-5)
    assert two_log["loss/value_avg"] == pytest.approx(one_log["loss/value_avg"], rel=1e-5)
    two_weights, one_weights = weights(tmp_path / "ddp"), weights(tmp_path / "one")
    assert max_difference(two_weights, initial_weights(tmp_path / "one"), "value_model.") > 1e-4  # it learned
    assert max_difference(two_weights, one_weights, "value_model.") < 1e-6


def test_zero2_with_several_micro_batches_per_pass_gives_the_same_update(tmp_path):
    # Under DeepSpeed the loss of a pass is divided by DeepSpeed itself (its gradient_accumulation_steps = passes
    # per minibatch): 2 micro-batches of 4 in one pass must step exactly like 2 passes. SGD without clipping keeps
    # the scale visible; the sampling is the same in both runs (same seeds, same layout of processes).
    flags = ["--optim", "sgd", "--learning_rate", "0.05", "--max_grad_norm", "0", "--num_ppo_epochs", "1"]
    flags += ["--total_episodes", "16"]
    launch("zero2", tmp_path / "split", *flags)
    launch("zero2", tmp_path / "merged", *flags, "--train_forward_batch_size", "8")
    split, merged = weights(tmp_path / "split"), weights(tmp_path / "merged")
    for prefix in ("policy.", "value_model."):
        assert max_difference(split, initial_weights(tmp_path / "split"), prefix) > 1e-4  # it learned
        assert max_difference(split, merged, prefix) < 1e-6, prefix


def check_saved_model(folder: Path, final: dict, prefix: str = "policy.") -> None:
    """`save_model` wrote a normal Hugging Face folder holding the full trained policy."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    expected = {k[len(prefix) :]: v for k, v in final.items() if k.startswith(prefix)}
    expected = {k.removeprefix("pretrained_model."): v for k, v in expected.items() if not k.startswith("v_head.")}
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.shape == expected[name].shape and tensor.numel() > 0
        assert torch.equal(tensor, expected[name]), name


# `critic_learning_rate` rides along in the saving runs (a launch each saved): its parameter groups go through
# DeepSpeed's engine and FSDP2's sharded parameters.
CRITIC_RATE = ["--critic_learning_rate", "5e-3"]


def check_critic_rate(reports: list[dict]) -> None:
    """The schedule moved both rates (linear decay over 2 updates: the first update's rates are the set ones)."""
    first = reports[0]["log_history"][0]
    assert first["lr"] == pytest.approx(1e-3) and first["lr_critic"] == pytest.approx(5e-3)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_trains_with_the_critics_own_rate_and_saves_a_full_model(tmp_path, stage):
    report_dir = tmp_path / stage
    reports = launch(stage, report_dir, *STOP_AT_EOS, *CRITIC_RATE, "--final_model_dir", str(tmp_path / "saved"))
    check_ranks_agree(reports, report_dir)
    assert reports[0]["global_step"] == 2
    check_critic_rate(reports)
    final = weights(report_dir)
    assert max_difference(final, initial_weights(report_dir), "policy.") > 1e-4
    assert max_difference(final, initial_weights(report_dir), "value_model.") > 1e-4
    check_saved_model(tmp_path / "saved", final)
    if stage == "zero3":  # sampling gathered each weight once per rollout (a few collectives per tensor), not
        # once per layer and sampled token
        assert all(0 < count <= 3 * reports[0]["policy_tensors"] for count in reports[0]["sampling_gathers"])


@pytest.mark.parametrize("layout", ["ddp", "zero2"])
def test_a_critic_free_estimator_trains_whole_groups_on_every_process(tmp_path, layout):
    """GRPO over groups of 4 on 2 processes: each process's batch of 8 is 2 whole groups (a group split across
    processes would not divide `per_device_train_batch_size * gradient_accumulation_steps`); no value function."""
    report_dir = tmp_path / layout
    flags = ["--value", "none", "--advantage_estimator", "grpo", "--num_generations", "4", *STOP_AT_EOS]
    reports = launch(layout, report_dir, *flags)
    check_ranks_agree(reports, report_dir)
    assert reports[0]["global_step"] == 2
    final = weights(report_dir)
    assert not any(name.startswith("value_model.") or "v_head" in name for name in final)
    assert max_difference(final, initial_weights(report_dir), "policy.") > 1e-4
    logged = reports[0]["log_history"][0]
    assert "loss/value_avg" not in logged and 0 <= logged["objective/frac_reward_zero_std"] <= 1


def test_zero2_bf16_reference_is_in_the_policys_precision(tmp_path):
    # DeepSpeed casts the policy's parameters to bf16; the frozen reference must be cast the same way, or the KL
    # of the first update (policy == reference) is not 0.
    report_dir = tmp_path / "bf16"
    reports = launch("zero2", report_dir, accelerate_flags=["--mixed_precision", "bf16"])
    check_ranks_agree(reports, report_dir)
    assert reports[0]["log_history"][0]["objective/kl"] == 0.0
    assert weights(report_dir)["policy.gpt_neox.embed_in.weight"].dtype == torch.bfloat16


def test_zero3_samples_from_partitioned_weights(tmp_path):
    # ds3_gather_for_generation=False: every sampled token runs layer by layer on partitioned weights, the processes
    # stepping together until all their responses stopped. With a value head on the policy's backbone.
    report_dir = tmp_path / "zero3_partitioned"
    flags = [*STOP_AT_EOS, "--ds3_gather_for_generation", "false", "--value", "head"]
    reports = launch("zero3", report_dir, *flags)
    check_ranks_agree(reports, report_dir)
    assert reports[0]["global_step"] == 2
    final = weights(report_dir)
    assert max_difference(final, initial_weights(report_dir), "policy.") > 1e-4
    assert any(k.startswith("policy.v_head.") for k in final)
    # Partitioned sampling gathers layer by layer at every sampled token (8 of them here).
    assert all(count > 4 * reports[0]["policy_tensors"] for count in reports[0]["sampling_gathers"])


def check_sharded(report: dict, models=("policy", "value_model", "ref")) -> None:
    """Each of `models` is split into FSDP2 units, and this process holds about half of its weights."""
    for role in models:
        local, full, units = report["shards"][role]
        assert units >= 2 and 0.4 * full < local < 0.6 * full, (role, report["shards"][role])


def test_fsdp2_trains_sharded_with_the_critics_own_rate_and_saves_a_full_model(tmp_path):
    # Policy, value model and reference each sharded over the two processes; the reference, sharded apart from the
    # policy, gives the same log-probs as the policy before the first step (KL 0); sampling gathers the policy's
    # units once per rollout, not at every token; `save_model` writes the whole policy.
    report_dir = tmp_path / "fsdp2"
    flags = [*STOP_AT_EOS, *CRITIC_RATE, "--final_model_dir", str(tmp_path / "saved")]
    reports = launch("fsdp2", report_dir, *flags)
    check_ranks_agree(reports, report_dir)
    for report in reports:
        check_sharded(report)
    assert reports[0]["global_step"] == 2
    check_critic_rate(reports)
    assert reports[0]["log_history"][0]["objective/kl"] == 0.0
    final = weights(report_dir)
    assert max_difference(final, initial_weights(report_dir), "policy.") > 1e-4
    assert max_difference(final, initial_weights(report_dir), "value_model.") > 1e-4
    check_saved_model(tmp_path / "saved", final)
    policy_units = reports[0]["shards"]["policy"][2]
    assert all(0 < count <= policy_units + 2 for count in reports[0]["sampling_gathers"])


def test_fsdp2_bf16_keeps_float32_log_probs_and_the_reference_in_the_policys_precision(tmp_path):
    # FSDP2 gathers and computes in bf16; the log-probs and values leave the sharded models in float32 (accelerate's
    # policy would cast them to bf16), and the reference, sharded apart, computes exactly as the policy (KL 0).
    report_dir = tmp_path / "fsdp2_bf16"
    reports = launch("fsdp2", report_dir, accelerate_flags=["--mixed_precision", "bf16"])
    check_ranks_agree(reports, report_dir)
    assert reports[0]["log_history"][0]["objective/kl"] == 0.0
    assert set(reports[0]["output_dtypes"].values()) == {"torch.float32"}  # log-probs, values, reference log-probs


def test_fsdp2_samples_from_sharded_weights(tmp_path):
    # ds3_gather_for_generation=False: each block's weights are gathered at each sampled token (the processes stepping
    # together until all their responses stopped). With a value head on the policy's backbone.
    report_dir = tmp_path / "fsdp2_sharded_sampling"
    flags = [*STOP_AT_EOS, "--ds3_gather_for_generation", "false", "--value", "head"]
    reports = launch("fsdp2", report_dir, *flags)
    check_ranks_agree(reports, report_dir)
    check_sharded(reports[0], ("policy", "ref"))
    final = weights(report_dir)
    assert max_difference(final, initial_weights(report_dir), "policy.") > 1e-4
    assert any(k.startswith("policy.v_head.") for k in final)
    policy_units = reports[0]["shards"]["policy"][2]
    assert all(count > 4 * policy_units for count in reports[0]["sampling_gathers"])  # 8 sampled tokens


# ZeRO-2 is left out: its checkpoint is DeepSpeed's engine checkpoint, as ZeRO-3's (saving it: the zero2 case of
# `test_deepspeed_trains_with_the_critics_own_rate_and_saves_a_full_model`); each case here costs two launches.
@pytest.mark.parametrize("layout", ["ddp", "zero3", "fsdp2", "fsdp2_full"])
def test_two_process_run_resumes_from_its_checkpoint(tmp_path, layout):
    # Run A: 2 updates with a checkpoint after each. Run B: a new output_dir holding only A's checkpoint-1, resumed.
    # B's second update repeats A's (the weights, optimizer, schedule and generators restored): same metrics and
    # the same final weights.
    flags = [*STOP_AT_EOS, "--save_strategy", "steps", "--save_steps", "1"]
    run_a = launch(layout, tmp_path / "a", *flags, "--output_dir", str(tmp_path / "a_out"))
    assert sorted(p for p in os.listdir(tmp_path / "a_out") if p.startswith("checkpoint-")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    shutil.copytree(tmp_path / "a_out" / "checkpoint-1", tmp_path / "b_out" / "checkpoint-1")
    resume = ["--output_dir", str(tmp_path / "b_out"), "--resume_from_checkpoint", "latest"]
    run_b = launch(layout, tmp_path / "b", *flags, *resume)
    check_ranks_agree(run_b, tmp_path / "b")
    assert run_b[0]["global_step"] == 2
    a_history = without_timing(run_a[0]["log_history"])
    b_history = without_timing(run_b[0]["log_history"])
    assert len(b_history) == len(a_history) and b_history[-1] == a_history[-1]  # update 1's entry came back
    a_final, b_final = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert max_difference(a_final, b_final, "") == 0.0
