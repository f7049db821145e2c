"""The one conversation model every API maps to (pure): messages, run loops, session identity."""
