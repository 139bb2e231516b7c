"""The Textual terminal app (`northcode`): chat and agent sessions on top of northcode.agent."""
