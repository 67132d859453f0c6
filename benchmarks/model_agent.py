"""The agent of benchmarks/model_latency.py: no tools and no model of its own, so every turn is one call
to the model named by GATEWAY_MODEL (the fake OpenAI-compatible server). GATEWAY_AGENT=model_agent:agent,
with this folder on PYTHONPATH."""

from gateway.agents import Agent

agent = Agent("Support", "You answer questions about orders in one sentence.")
