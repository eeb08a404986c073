"""`distributed.checked_on_every_process`: a check of one process's own inputs (`step()`'s episodes, `generate()`'s
queries) that fails on one process only stops every process, instead of leaving the others waiting in the next
collective; so does a reward function that hangs on one process. Two CPU processes over gloo, no model (a few
seconds)."""

import os
import socket
import threading

import pytest
import torch
import torch.multiprocessing as mp

from trl_ppo import distributed as dist

pytestmark = pytest.mark.distributed  # two processes; the quick loop leaves them out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_then_collective(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:

        def check():
            if rank == 1:
                raise ValueError("query 3 has an id beyond the vocabulary")
            return "checked"

        try:
            outcome = dist.checked_on_every_process(check, torch.device("cpu"), "`step()` episodes")
            torch.distributed.barrier()  # what the update would do next: rank 0 must not get here alone
        except ValueError as error:
            outcome = f"ValueError: {error}"
        results[rank] = outcome
    finally:
        torch.distributed.destroy_process_group()


def on_two_processes(target) -> dict:
    """Run `target(rank, port, results)` in two processes -> {rank: what it put in `results`}; neither may hang."""
    results = mp.Manager().dict()
    context = mp.start_processes(target, args=(free_port(), results), nprocs=2, join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=120)
    assert not any(process.is_alive() for process in context.processes), "a process hangs"
    return dict(results)


def test_a_check_failing_on_one_process_stops_every_process():
    results = on_two_processes(check_then_collective)
    assert results[1] == "ValueError: query 3 has an id beyond the vocabulary"
    assert results[0] == "ValueError: Another process's `step()` episodes were refused (its error says why); " \
                         "this process stops too."


def test_in_one_process_the_check_is_just_called():
    assert dist.checked_on_every_process(lambda: 7, torch.device("cpu"), "x") == 7
    with pytest.raises(TypeError, match="bad"):
        dist.checked_on_every_process(lambda: (_ for _ in ()).throw(TypeError("bad")), torch.device("cpu"), "x")


def reward_then_collective(rank: int, port: int, results) -> None:
    """Rank 1's reward function never answers; rank 0's does. Both must stop, neither wait in the collective."""
    from trl_ppo.deadlines import Deadlines, UserCallError
    from trl_ppo.reward_functions import reward_function_scores

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    release = threading.Event()
    try:

        def judge(prompts, completions):
            if rank == 1:
                release.wait(60)
            return [1.0] * len(completions)

        try:
            reward_function_scores(judge, "judge", ["p"], ["c"], {}, "cpu", Deadlines(reward=0.3, retries=0))
            torch.distributed.barrier()  # what the update would do next: rank 0 must not get here alone
            results[rank] = "scored"
        except UserCallError as error:
            results[rank] = str(error)
    finally:
        release.set()
        torch.distributed.destroy_process_group()


def test_a_reward_function_that_hangs_on_one_process_stops_every_process():
    results = on_two_processes(reward_then_collective)
    assert results[1].startswith("Reward function 'judge' did not return within 0.3 s on its only try"), results[1]
    assert results[0] == "Another process's reward function 'judge' failed (its error says why); this process " \
                         "stops too.", results[0]
