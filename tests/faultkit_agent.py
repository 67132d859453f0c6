"""The agent of fault runs that exercise a model provider: it names no model, so it runs on
GATEWAY_MODEL (`openai:fake`, the fake server of tests/faultkit.py)."""

from gateway.agents import Agent

agent = Agent("Orders", "Answer questions about orders in one sentence.")
