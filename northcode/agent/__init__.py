"""The agent: a streaming OpenAI client, tools inside a sandboxed workspace, approvals, the loop, sessions.

It talks to the model only over HTTP (any OpenAI-compatible endpoint); it never imports the engine.
"""
