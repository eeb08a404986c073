"""The probe's cases of user code as users write it (issue 53, part 4): rewards and tools that are not misbehaviours
(an HTTP judge, `subprocess`, `multiprocessing`, math_verify and `SIGALRM`, torch, a C call that holds the GIL, a
library bound to the thread that made it), each run under the DEFAULT deadlines (no `--reward_timeout` etc.). The
wanted outcome is `worked`: the run finished, every call of the user code said `PROBE WORKED` (it checks its own
result) and none said `PROBE FAILED`, and its scores reached the log (rewards) or the model read its answer (tools,
`TOOL ANSWER:` printed by the driver). `finished, not worked` is a run that finished without that evidence.

The reward cases (`USER_REWARDS`, here) run `trl-ppo train` on the tiny default job (`cli_case`'s, without its small
deadlines); the tool and environment cases (`USER_AGENTS`, in `probe_usercode_agents.py`) run
`probe_agents.run_agent` with their `USER_AGENT_CODE` beside its `AGENT_CODE`."""

from __future__ import annotations

import json
from pathlib import Path

from probe_cases import NOTES, SMALL, TINY, TRL_PPO, Case, reward_file

TINY_DEFAULTS = [flag for flag in TINY if flag not in SMALL]  # the tiny job under the default deadlines
WORK = 30.0  # seconds the cases' own work may add to a tiny run (a hang under the defaults waits 300 s per try)
WORKED = ("PROBE WORKED",)

# A local HTTP judge: scores a completion by its length; started at import in a daemon thread, as a test server is.
JUDGE = """
import json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Judge(BaseHTTPRequestHandler):
    def do_POST(self):
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = json.dumps({"score": len(asked["completion"].split()) / 10}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass

class Server(ThreadingHTTPServer):
    request_queue_size = 128  # 16 requests at once: the default backlog of 5 resets some (ReadError)

SERVER = Server(("127.0.0.1", 0), Judge)
threading.Thread(target=SERVER.serve_forever, daemon=True).start()
URL = f"http://127.0.0.1:{SERVER.server_port}/judge"

def expected(completions):
    return [len(c.split()) / 10 for c in completions]
"""

MATH_VERIFY = r"""
from math_verify import parse, verify

def probe(prompts, completions, answer, **kw):
    golds = [parse(a) for a in answer]
    scores = [float(verify(gold, parse(c))) for gold, c in zip(golds, completions)]
    sane = verify(parse("$\\frac{1}{2}$"), parse("0.5"))
    parsed = sum(bool(g) for g in golds)
    ok = parsed == len(golds) and sane
    print(f"PROBE {'WORKED' if ok else 'FAILED'}: math_verify parsed {parsed} of {len(golds)}, 1/2 == 0.5: {sane}")
    return scores
"""

ASYNC_MATH_VERIFY = r"""
from math_verify import parse, verify

async def probe(prompts, completions, answer, **kw):  # async, as a reward that also awaits a judge is
    golds = [parse(a) for a in answer]
    scores = [float(verify(gold, parse(c))) for gold, c in zip(golds, completions)]
    print(f"PROBE {'WORKED' if all(golds) else 'FAILED'}: math_verify in an async reward")
    return scores
"""

SIGALRM = """
import signal

class OverBudget(Exception): pass

def over_budget(signum, frame):
    raise OverBudget

def bounded(seconds, check):
    previous = signal.signal(signal.SIGALRM, over_budget)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return check()
    except OverBudget:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

def stuck():  # a verifier that never ends on a hard case: its own alarm must stop it
    while True:
        pass

def probe(prompts, completions, **kw):
    scores = [bounded(5, lambda c=c: float(len(c.split()) > 2)) for c in completions]
    cut = bounded(0.3, stuck)
    print(f"PROBE {'WORKED' if cut is None else 'FAILED'}: its SIGALRM stopped a stuck check")
    return scores
"""

HTTP_JUDGE = JUDGE + """
import requests

SESSION = requests.Session()

def probe(prompts, completions, **kw):
    scores = [SESSION.post(URL, json={"prompt": p, "completion": c}, timeout=60).json()["score"]
              for p, c in zip(prompts, completions)]
    print(f"PROBE {'WORKED' if scores == expected(completions) else 'FAILED'}: the judge scored {len(scores)}")
    return scores
"""

ASYNC_HTTP_JUDGE = JUDGE + """
import asyncio
import httpx

CLIENT = httpx.AsyncClient(timeout=60)  # made at import, used on the run's event loop

async def probe(prompts, completions, **kw):
    async def one(p, c):
        return (await CLIENT.post(URL, json={"prompt": p, "completion": c})).json()["score"]

    scores = await asyncio.gather(*(one(p, c) for p, c in zip(prompts, completions)))
    print(f"PROBE {'WORKED' if scores == expected(completions) else 'FAILED'}: the judge scored {len(scores)}")
    return scores
"""

ASYNCIO_RUN_JUDGE = JUDGE + """
import asyncio
import httpx

async def judge_all(prompts, completions):
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(URL, json={"prompt": p, "completion": c})
                                         for p, c in zip(prompts, completions)))
    return [answer.json()["score"] for answer in answers]

def probe(prompts, completions, **kw):  # a sync reward around an async client
    scores = asyncio.run(judge_all(prompts, completions))
    print(f"PROBE {'WORKED' if scores == expected(completions) else 'FAILED'}: the judge scored {len(scores)}")
    return scores
"""

THREAD_POOL_JUDGE = JUDGE + """
from concurrent.futures import ThreadPoolExecutor
import requests

POOL = ThreadPoolExecutor(8)  # the judge asked 8 at a time

def ask(p, c):
    return requests.post(URL, json={"prompt": p, "completion": c}, timeout=60).json()["score"]

def probe(prompts, completions, **kw):
    scores = list(POOL.map(ask, prompts, completions))
    print(f"PROBE {'WORKED' if scores == expected(completions) else 'FAILED'}: the judge scored {len(scores)}")
    return scores
"""

SUBPROCESS = """
import subprocess, sys

CHECK = "import sys; print(len(sys.stdin.read().split()))"

def probe(prompts, completions, **kw):
    scores = []
    for c in completions:  # a sandbox-like verifier: one process per completion
        done = subprocess.run([sys.executable, "-c", CHECK], input=c, capture_output=True, text=True, timeout=60,
                              check=True)
        scores.append(int(done.stdout) / 10)
    ok = scores == [len(c.split()) / 10 for c in completions]
    print(f"PROBE {'WORKED' if ok else 'FAILED'}: {len(scores)} subprocesses")
    return scores
"""

POOL = """
import multiprocessing

def count_words(text):
    return len(text.split())

def probe(prompts, completions, **kw):
    with multiprocessing.Pool(2) as pool:
        counts = pool.map(count_words, completions)
    ok = counts == [len(c.split()) for c in completions]
    print(f"PROBE {'WORKED' if ok else 'FAILED'}: a Pool of 2 counted {len(counts)}")
    return [n / 10 for n in counts]
"""

POOL_BUILTIN = """
import multiprocessing

def probe(prompts, completions, **kw):
    with multiprocessing.Pool(2) as pool:
        lengths = pool.map(len, completions)  # a builtin: pickled by name, whatever the file's module is
    ok = lengths == [len(c) for c in completions]
    print(f"PROBE {'WORKED' if ok else 'FAILED'}: a Pool of 2 measured {len(lengths)}")
    return [n / 100 for n in lengths]
"""

PROCESS_POOL = """
from concurrent.futures import ProcessPoolExecutor

def count_words(text):
    return len(text.split())

def probe(prompts, completions, **kw):
    with ProcessPoolExecutor(max_workers=2) as pool:
        counts = list(pool.map(count_words, completions))
    ok = counts == [len(c.split()) for c in completions]
    print(f"PROBE {'WORKED' if ok else 'FAILED'}: a ProcessPoolExecutor counted {len(counts)}")
    return [n / 10 for n in counts]
"""

TORCH = """
import torch

torch.manual_seed(0)
EMBED = torch.nn.Embedding(256, 16)  # a tiny embedding "model", made at import
GOOD = EMBED(torch.tensor(list(b"good great"))).mean(0)

def probe(prompts, completions, **kw):
    with torch.no_grad():
        vectors = torch.stack([EMBED(torch.tensor(list(c.encode()) or [0])).mean(0) for c in completions])
        scores = torch.nn.functional.cosine_similarity(vectors, GOOD.expand_as(vectors), dim=-1)
    ok = bool(torch.isfinite(scores).all()) and not scores.requires_grad
    print(f"PROBE {'WORKED' if ok else 'FAILED'}: cosine similarity of {len(scores)}")
    return scores.tolist()
"""

HOLDS_GIL = """
import re, time

def probe(prompts, completions, **kw):
    start = time.monotonic()
    stuck = re.fullmatch(r"(a+)+b", "a" * 26)  # about 2 s in C, the GIL held throughout
    seconds = time.monotonic() - start
    print(f"PROBE {'WORKED' if stuck is None else 'FAILED'}: a regex held the GIL {seconds:.1f} s")
    return [len(c.split()) / 10 for c in completions]
"""

SQLITE = """
import os, sqlite3

DB = sqlite3.connect(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache.db"))  # at import
DB.execute("CREATE TABLE IF NOT EXISTS scores (completion TEXT PRIMARY KEY, score REAL)")

def probe(prompts, completions, **kw):  # a judge's answers cached in sqlite, as a costly judge's are
    scores = []
    for c in completions:
        row = DB.execute("SELECT score FROM scores WHERE completion = ?", (c,)).fetchone()
        if row is None:
            row = (len(c.split()) / 10,)
            DB.execute("INSERT INTO scores VALUES (?, ?)", (c, row[0]))
        scores.append(row[0])
    DB.commit()
    print(f"PROBE WORKED: {len(scores)} scores through the sqlite cache")
    return scores
"""

THREAD_LOCAL = """
import threading

STATE = threading.local()
STATE.calls = 0  # set at import, in the thread that imports

def probe(prompts, completions, **kw):
    STATE.calls += 1
    print(f"PROBE WORKED: call {STATE.calls} read its thread-local state")
    return [len(c.split()) / 10 for c in completions]
"""


def math_data(folder: Path) -> Path:
    """The shipped prompts with an `answer` column (a math gold each), as a math dataset has."""
    from importlib import resources

    rows = resources.files("trl_ppo").joinpath("default_data/prompts.jsonl").read_text().splitlines()
    path = folder / "math.jsonl"
    golds = ["$\\frac{1}{2}$", "$2$", "$\\sqrt{2}$", "$x^2 + 1$"]
    path.write_text("".join(json.dumps({**json.loads(row), "answer": golds[i % 4]}) + "\n"
                            for i, row in enumerate(rows)))  # fmt: skip
    return path


def user_reward(body: str, data: bool = False):
    """A CLI case: the tiny default job under the default deadlines, with the reward `probe` defined by `body`."""

    def setup(folder: Path) -> dict:
        output = folder / "out"
        output.mkdir()
        (output / NOTES).write_text("mine\n")
        command = [*TRL_PPO, "train", *TINY_DEFAULTS, "--reward_function", reward_file(folder, body),
                   "--output_dir", str(output)]  # fmt: skip
        if data:
            command += ["--dataset_name", str(math_data(folder))]
        return {"command": command, "output_dir": output}

    return setup


def reward(name: str, body: str, note: str = "", data: bool = False) -> Case:
    # bug=True: where such code stops a run, the traceback into it is what its user needs, as for a bug
    return Case(name, "reward", "probe", user_reward(body, data), bound=WORK, bug=True, works=True,
                evidence=("objective/scores/probe", *WORKED), note=note)  # fmt: skip


USER_REWARDS = [
    reward("user_math_verify", MATH_VERIFY, "math_verify's parse/verify (signal.alarm) on an answer column", True),
    reward("user_async_math_verify", ASYNC_MATH_VERIFY, "the same in an `async def` reward (on the loop's thread)",
           True),
    reward("user_sets_sigalrm", SIGALRM, "a verifier bounding a stuck check with its own SIGALRM"),
    reward("user_http_judge", HTTP_JUDGE, "requests.post to a judge served at import"),
    reward("user_async_http_judge", ASYNC_HTTP_JUDGE, "async def; an httpx.AsyncClient made at import, gather"),
    reward("user_asyncio_run_judge", ASYNCIO_RUN_JUDGE, "a sync reward calling asyncio.run(httpx client)"),
    reward("user_thread_pool_judge", THREAD_POOL_JUDGE, "requests in a ThreadPoolExecutor made at import"),
    reward("user_subprocess", SUBPROCESS, "subprocess.run([sys.executable, '-c', ...]) per completion"),
    reward("user_pool", POOL, "multiprocessing.Pool (fork) mapping a function of the reward file"),
    reward("user_pool_builtin", POOL_BUILTIN, "multiprocessing.Pool (fork) mapping len"),
    reward("user_process_pool", PROCESS_POOL, "ProcessPoolExecutor mapping a function of the reward file"),
    reward("user_torch", TORCH, "a tiny torch embedding, cosine similarity under no_grad"),
    reward("user_holds_gil", HOLDS_GIL, "a regex holding the GIL ~2 s per call, well within the deadline"),
    reward("user_sqlite_cache", SQLITE, "an sqlite3 connection made at import (same-thread only)"),
    reward("user_thread_local", THREAD_LOCAL, "threading.local set at import"),
]
