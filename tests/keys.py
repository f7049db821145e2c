"""Credentials of the lengths and alphabets real ones have, made the same way on every run
(a seed): an OpenAI project key (164 characters), an Anthropic key (108) and a JWT bearer
of about 2 KB (an Azure AD access token's size)."""

from __future__ import annotations

import base64
import random
import string

URLSAFE = string.ascii_letters + string.digits + "-_"


def _text(rng: random.Random, n: int, alphabet: str = URLSAFE) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def openai_project_key(seed: int = 0) -> str:
    """``sk-proj-`` + 156 characters, with OpenAI's ``T3BlbkFJ`` inside: 164 in all."""
    rng = random.Random(f"openai-{seed}")
    return f"sk-proj-{_text(rng, 74)}T3BlbkFJ{_text(rng, 74)}"


def anthropic_key(seed: int = 0) -> str:
    """``sk-ant-api03-`` + 93 characters + ``AA``: 108 in all."""
    rng = random.Random(f"anthropic-{seed}")
    return f"sk-ant-api03-{_text(rng, 93)}AA"


def jwt(seed: int = 0, size: int = 2048) -> str:
    """A JWT of ``size`` characters: header, claims and an RS256 signature, base64url."""
    rng = random.Random(f"jwt-{seed}")

    def part(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    head = part(b'{"alg":"RS256","typ":"JWT","kid":"' + _text(rng, 27).encode() + b'"}')
    signature = part(rng.randbytes(256))
    claims_len = size - len(head) - len(signature) - 2
    claims = part(('{"aud":"https://cognitiveservices.azure.com","groups":["'
                   + _text(rng, claims_len, string.hexdigits.lower()) + '"]}').encode())
    return f"{head}.{claims[:claims_len]}.{signature}"



# dated model names, as clients send them (a proxy that keys anything by a model's
# undated alias, or cuts a name at its first dash, shows with these)
OPENAI_MODEL = "gpt-4.1-2025-04-14"
OPENAI_MINI_MODEL = "gpt-4.1-mini-2025-04-14"
# (the anthropic SDK warns, and filterwarnings=error fails, on a model it lists deprecated:
# claude-sonnet-4-5-20250929 is one since late 2026)
ANTHROPIC_MODEL = "claude-haiku-4-5-20251001"
ANTHROPIC_LATEST_MODEL = "claude-sonnet-4-6"
