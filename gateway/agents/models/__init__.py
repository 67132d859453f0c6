"""Built-in models: the offline ScriptedModel and any OpenAI-compatible Chat Completions server."""
