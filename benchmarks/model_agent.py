"""The agents of benchmarks/model_latency.py, with this folder on PYTHONPATH.

`agent` (GATEWAY_AGENT=model_agent:agent) has no tools and no model of its own, so every turn is one
call to the model named by GATEWAY_MODEL (the fake OpenAI-compatible server).

`in_process_agent` (GATEWAY_AGENT=model_agent:in_process_agent) answers after BENCH_MODEL_LATENCY
seconds in the gateway's own process, naming the order as the fake server does: a model whose call
costs nothing, so its run is the bound of what a faster model client could give."""

import asyncio
import os
from collections.abc import Sequence

from gateway.agents import Agent, Message
from gateway.agents.models.base import ToolSpec
from gateway.agents.models.scripted import Rule, ScriptedModel

INSTRUCTIONS = "You answer questions about orders in one sentence."

agent = Agent("Support", INSTRUCTIONS)


class _WaitingModel:
    """The scripted model, after the latency."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.answer = ScriptedModel(rules=[Rule(r"order (\d+)", reply="Your order {0} is on its way.")])

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        await asyncio.sleep(self.latency)
        return await self.answer.respond(agent, history, tools)


in_process_agent = Agent(
    "Support", INSTRUCTIONS, model=_WaitingModel(float(os.environ.get("BENCH_MODEL_LATENCY", "1")))
)
