"""A small verifiers (0.4) environment, written as one would publish it, for flatrl's tests and its CPU example
(`PYTHONPATH=tests python train.py --task vf:vf_calc`): a taskset of multiplications ('What is 347 * 28?') rewarded
by its own reward function, and a harness: an agent program on the OpenAI client that offers a calculator tool, runs
the calls the replies make and sends the results back, until a reply calls nothing. It knows nothing of flatrl.

The harness config's `trouble` makes every other task's rollout misbehave, for the tests: "raise" (the program
fails), "hang" (it waits forever without blocking), "block" (it starts a program in a session of its own, as
verifiers starts a harness's, writes its pid to `pidfile`, then blocks its whole process), "stdin" (a program it
starts reads its standard input)."""
import asyncio
import json
import random
import re
import subprocess
import time

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

__all__ = ["CalcTaskset", "CalcHarness"]

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: two numbers and one of + - * /.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12 * 34"}},
                   "required": ["expression"]}}}
ASK = " You can use a calculator."
EXAMPLE = [{"role": "user", "content": "What is 1234 + 5678?" + ASK},  # a worked example: the form of a call
           {"role": "assistant", "content": "calculator: 1234 + 5678"},
           {"role": "tool", "tool_call_id": "example", "content": "calculator result: 6912"},
           {"role": "assistant", "content": "6912"}]


def calculate(arguments):
    """The tool: 'a op b' of two numbers -> 'calculator result: N', or an error text (never raised)."""
    try:
        found = re.fullmatch(r"\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*", json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError):
        found = None
    if not found:
        return "error: give an expression of two numbers and one of + - * /"
    a, op, b = int(found[1]), found[2], int(found[3])
    if op == "/" and b == 0:
        return "error: division by zero"
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0}[op]
    return f"calculator result: {value:g}" if isinstance(value, float) else f"calculator result: {value}"


class CalcData(vf.TaskData):
    answer: int = 0


class CalcTask(vf.Task[CalcData]):
    @vf.reward(weight=1.0)
    async def right(self, trace: vf.Trace) -> float:
        """1 if the last number of the final reply is the product."""
        found = re.findall(r"-?\d+", (trace.last_reply or "").replace(",", ""))
        return float(bool(found) and int(found[-1]) == self.data.answer)


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 200
    seed: int = 0


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            prompt = [*EXAMPLE, {"role": "user", "content": f"What is {a} * {b}?" + ASK}]
            yield CalcTask(CalcData(prompt=prompt, answer=a * b), self.config.task)


class CalcHarnessConfig(vf.HarnessConfig):
    max_calls: int = 3
    trouble: str = ""  # "", "raise", "hang", "block" or "stdin": every other task's rollout (the tests')
    pidfile: str = ""


class CalcHarness(vf.Harness[CalcHarnessConfig]):
    """The agent, in-process (verifiers allows a harness its own loop where every model call goes through the
    interception endpoint): the OpenAI client, the calculator offered as a tool."""
    EXECUTES_CODE = False  # the tool is this module's calculator; no model-written code runs
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        if data.idx % 2 and self.config.trouble:
            await self.misbehave()
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages = [dict(m) if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in data.prompt]
        for _ in range(self.config.max_calls):
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                          tools=[CALCULATOR])).choices[0].message
            if not reply.tool_calls:
                break
            messages.append(reply.model_dump(exclude_none=True))
            for call in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
        return ProgramResult(exit_code=0, stdout="", stderr="")

    async def misbehave(self):
        if self.config.trouble == "raise":
            raise RuntimeError("the agent program failed")
        if self.config.trouble == "hang":
            await asyncio.sleep(10**6)
        if self.config.trouble == "block":
            program = subprocess.Popen(["sleep", "1000"], start_new_session=True)
            with open(self.config.pidfile, "a") as f:
                f.write(f"{program.pid}\n")
            time.sleep(10**6)
        if self.config.trouble == "stdin":  # it must read nothing (no command of the trainer's) and end at once
            subprocess.run(["cat"], stdout=subprocess.DEVNULL, timeout=5, check=True)
