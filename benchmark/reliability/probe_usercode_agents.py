"""The probe's tool and environment cases of user code as users write it (`USER_AGENTS`; the reward cases and what
`worked` means: `probe_usercode.py`): the user code (`USER_AGENT_CODE`, run beside `probe_agents.AGENT_CODE`, whose
imports and `Base` it uses) under the default deadlines; the driver prints the first tool answer the model read."""

from __future__ import annotations

from probe_agents import agent_case
from probe_cases import Case
from probe_usercode import JUDGE, WORK, WORKED

USER_AGENT_CODE = JUDGE + r'''
import signal, subprocess, urllib.request


def tool_subprocess(a: int) -> str:
    """Square a number in a subprocess.

    Args:
        a: the number.
    """
    done = subprocess.run([sys.executable, "-c", f"print({a} * {a})"], capture_output=True, text=True, timeout=60)
    return f"PROBE {'WORKED' if done.stdout.strip() == str(a * a) else 'FAILED'} {done.stdout.strip()}"


def tool_http(a: int) -> str:
    """Ask the judge.

    Args:
        a: the number.
    """
    asked = json.dumps({"completion": "x " * a}).encode()
    request = urllib.request.Request(URL, data=asked, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        score = json.loads(answer.read())["score"]
    return f"PROBE {'WORKED' if score == a / 10 else 'FAILED'} {score}"


def tool_signal_alarm(a: int) -> str:
    """A check bounded by its own SIGALRM.

    Args:
        a: the number.
    """
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.alarm(10)
    try:
        return f"PROBE WORKED {a}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


async def tool_async_subprocess(a: int) -> str:
    """Square a number in a subprocess, asynchronously.

    Args:
        a: the number.
    """
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", f"print({a} * {a})",
                                                   stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    return f"PROBE {'WORKED' if out.decode().strip() == str(a * a) else 'FAILED'} {out.decode().strip()}"


def tool_math_verify(a: int) -> str:
    """Check an answer with math_verify.

    Args:
        a: the number.
    """
    from math_verify import parse, verify

    return f"PROBE {'WORKED' if verify(parse(f'${a}$'), parse(str(a))) else 'FAILED'} {a}"


class env_sandbox(Base):  # a subprocess per episode, started in reset, ended in close
    def reset(self, **row):
        code = "import sys\nfor line in sys.stdin: print(int(line) * 2, flush=True)"
        self.sandbox = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        return super().reset(**row)

    def get_reward(self):
        self.sandbox.stdin.write("21\n")
        self.sandbox.stdin.flush()
        ok = self.sandbox.stdout.readline().strip() == "42"
        print(f"PROBE {'WORKED' if ok else 'FAILED'}: the sandbox answered")
        return float(ok)

    def close(self):
        self.sandbox.terminate()
        self.sandbox.wait(timeout=60)


class env_math_verify(Base):
    def get_reward(self):
        from math_verify import parse, verify

        gold = parse("$\\frac{1}{2}$")
        ok = bool(gold) and verify(gold, parse("The answer is 0.5"))
        print(f"PROBE {'WORKED' if ok else 'FAILED'}: get_reward's math_verify")
        return float(ok)
'''


def user_agent(name: str, note: str, evidence: tuple[str, ...] = ("TOOL ANSWER: PROBE WORKED",)) -> Case:
    kind = "environment" if name.startswith("env_") else "tool"
    return Case(name, kind, name, agent_case(name), bound=WORK, works=True, evidence=evidence, note=note)


USER_AGENTS = [
    user_agent("tool_subprocess", "a sync tool: subprocess.run"),
    user_agent("tool_http", "a sync tool: urllib to a judge served at import"),
    user_agent("tool_signal_alarm", "a sync tool setting SIGALRM (documented: it runs in a thread)"),
    user_agent("tool_async_subprocess", "an async tool: asyncio.create_subprocess_exec"),
    user_agent("tool_math_verify", "a sync tool calling math_verify (documented: it runs in a thread)"),
    user_agent("env_math_verify", "an environment's get_reward calling math_verify", evidence=WORKED),
    user_agent("env_sandbox", "an environment's subprocess: Popen in reset, used in get_reward, ended in close",
               evidence=WORKED),
]
USER_AGENT_NAMES = {case.name for case in USER_AGENTS}
