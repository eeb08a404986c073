"""How many threads torch uses on the CPU when the user did not say (`OMP_NUM_THREADS` unset).

torch starts one thread per core. On a machine whose cores other processes already keep busy, those threads wait
on each other at every operation: the demos ran 6 to 10 times slower than on the same cores idle, and one thread
fixed most of it (`benchmark/speed/cpu_threads.py` measures it). So `trl-ppo` uses the cores that the 1-minute load
average leaves free, at least one, at most torch's own choice."""

from __future__ import annotations

import os


def chosen_threads(environ, cores: int, load: float, default: int) -> int | None:
    """The threads to use, or None to leave torch's `default` (the user set `OMP_NUM_THREADS`, or no core is
    busier than that)."""
    if "OMP_NUM_THREADS" in environ:
        return None
    free = max(1, int(cores - load + 0.5))
    return free if free < default else None


def set_cpu_threads(log=print) -> int | None:
    """Apply `chosen_threads` to torch when no CUDA device will run the model; -> the number set, or None."""
    import torch

    if torch.cuda.is_available() or not hasattr(os, "getloadavg"):
        return None
    threads = chosen_threads(os.environ, os.cpu_count() or 1, os.getloadavg()[0], torch.get_num_threads())
    if threads is not None:
        torch.set_num_threads(threads)
        log(f"trl-ppo: {threads} CPU thread(s) (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: more threads "
            "would wait on each other); set OMP_NUM_THREADS to choose.")
    return threads
