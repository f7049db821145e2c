"""The window: what part of a conversation goes to the LLM, under the token budget (pure)."""
