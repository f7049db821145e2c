"""The HTTP surface clients talk to: chat completions, Responses, everything else passed through."""
