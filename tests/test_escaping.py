"""The inspector's escaping, swept: a corpus of hostile strings — markup, attribute breakers,
``javascript:`` links, control characters, bidi overrides — stored in every field a page
shows (session ids and tenant namespaces, message text, names, tool names, call ids and
arguments, tool results, replies, summaries, compaction records, the proxy's tool rounds,
branches) and in every parameter a page reflects, and every page rendered and parsed with
``html.parser``: no element and no attribute came from stored data.

What a page may contain is learned, not listed: the same pages are rendered for a twin of
the data whose strings are plain letters of the same lengths, and the hostile render may hold
only elements and attributes the plain one has (the same attribute values, where a value is
not data), links only to the inspector itself, no comment, no declaration but the doctype. A
page or field added later is swept the day it shows stored data."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.history.summaries import OMIT
from runloop_proxy.history.writes import prepare
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_config import ACME_KEY, write_config

ADMIN_KEY = "admin-0123456789abcdef"
CORPUS = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(2)>",
    "\"><svg onload=alert(3)>",
    "'><iframe srcdoc='<b>4</b>'>",
    "' onmouseover='alert(5)' x='",
    "\" onfocus=\"alert(6)\" autofocus x=\"",
    "javascript:alert(7)",
    "</pre></td></tr></table><form action=//evil.example><button>8",
    "<!-- 9 --><![CDATA[ 9 ]]><?php 9 ?>",
    "&lt;b&gt;10&lt;/b&gt; &amp; &#x3C;",
    "ctl\x00\x01\x07\x08\x0b\x1b[31m11\x7f\x9b",
    "\u202eevil\u202c \u2066iso\u2069 \u200f12 \u2028\u2029",
]
# attributes whose value is data (a link, a form field's value): checked by rule, not value
DATA_ATTRIBUTES = {"href", "action", "value", "points"}
URL_ATTRIBUTES = {"href", "action", "src", "formaction", "xlink:href"}


def plain(text: str, k: int) -> str:
    """The benign twin of a hostile string: letters and spaces, the same length."""
    return "".join(c if c.isalnum() and c.isascii() else "x" if i % 3 else " "
                   for i, c in enumerate(text)) + f" {k}"


class Page(HTMLParser):
    """What a page is made of: its elements with their attributes, comments, declarations,
    processing instructions, and the text it shows."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, tuple[tuple[str, str | None], ...]]] = []
        self.odd: list[str] = []
        self.text: list[str] = []
        self.styles: list[str] = []  # the page's stylesheet
        self._in: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, tuple(attrs)))
        self._in.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._in:
            del self._in[len(self._in) - 1 - self._in[::-1].index(tag):]

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, tuple(attrs)))

    def handle_comment(self, data: str) -> None:
        self.odd.append(f"comment <!--{data}-->")

    def handle_decl(self, decl: str) -> None:
        if decl.lower() != "doctype html":
            self.odd.append(f"declaration <!{decl}>")

    def unknown_decl(self, data: str) -> None:
        self.odd.append(f"declaration <![{data}]>")

    def handle_pi(self, data: str) -> None:
        self.odd.append(f"processing instruction <?{data}>")

    def handle_data(self, data: str) -> None:
        (self.styles if self._in[-1:] == ["style"] else self.text).append(data)


Shape = dict[tuple[str, str], set[str | None]]  # (element, attribute) -> values seen


def shape(pages: list[Page]) -> Shape:
    out: Shape = defaultdict(set)
    for page in pages:
        # a class the stylesheet styles is the template's, whichever element shows it
        for name in re.findall(r"\.([A-Za-z][\w-]*)", "".join(page.styles)):
            out[("*", "class")].add(name)
        for tag, attrs in page.elements:
            out[(tag, "")].add(None)
            for name, value in attrs:
                out[(tag, name)].add(value)
    return out


def violations(page: Page, allowed: Shape) -> Iterator[str]:
    yield from page.odd
    for tag, attrs in page.elements:
        if (tag, "") not in allowed:
            yield f"element <{tag}> {attrs}"
            continue
        for name, value in attrs:
            if (tag, name) not in allowed:
                yield f"attribute {name}={value!r} on <{tag}>"
            elif name in URL_ATTRIBUTES and not (value or "").startswith("/admin/ui"):
                yield f"a link out of the inspector: <{tag} {name}={value!r}>"
            elif name not in DATA_ATTRIBUTES and value not in allowed[(tag, name)] \
                    and not (name == "class" and value in allowed[("*", "class")]):
                yield f"attribute value <{tag} {name}={value!r}> (the template never writes it)"


# -- the stored data ---------------------------------------------------------------------------

def converse(proxy: ProxyServer, upstream: ScriptedUpstream, session: str,
             strings: list[str]) -> None:
    """A session through the proxy in which turn k carries ``strings[k]`` in every field a
    client or the model fills: the user's text and name, the model's call (id, tool name,
    arguments), the tool's result, the final reply; the last turn stays open with large
    results (elided), and the model's recall (a proxy tool round) returns one of them."""
    c = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                      default_headers={"X-Session-Id": session})
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"You help. {strings[0]}"}]
    for k, s in enumerate(strings):
        call = {"id": f"call_{k}_{s}", "type": "function",
                "function": {"name": s, "arguments": orjson.dumps({"q": s}).decode()}}
        msgs += [{"role": "user", "content": f"{s} question {k}", "name": s},
                 {"role": "assistant", "content": s, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": f"{s} result {k} "
                  + "row " * (1500 if k == len(strings) - 1 else 40)}]
        if k < len(strings) - 1:
            upstream.push({"content": f"{s} answer {k}"})
        else:  # the open loop: the model recalls, then answers
            upstream.push({"tool_calls": [{"id": f"rc_{k}", "name": "recall_tool_call",
                                           "arguments": {"call_id": call["id"]}}]},
                          {"content": f"{s} answer {k}"})
        r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                      user=s)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        proxy.settle()


def store_directly(proxy: ProxyServer, namespace: str, s: str) -> str:
    """A session stored under the key ``n:<s>`` (so the inspector shows ``s`` as its id),
    whose every field — messages, a compaction record, a summary and an omission, a proxy
    tool round, a branch — holds ``s``: what a corrupted or hand-edited store would show."""
    store = proxy.state.store
    sid = "n:" + s
    call = {"id": s, "type": "function", "function": {"name": s, "arguments": s}}
    messages = [{"role": "system", "content": s}, {"role": "user", "content": s, "name": s},
                {"role": "assistant", "content": s, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": s, "content": s, "name": s},
                {"role": "assistant", "content": s},
                # content as parts: a text part, an image by URL, a part of a type nobody knows
                {"role": "user", "content": [{"type": "text", "text": s},
                                             {"type": "image_url", "image_url": {"url": s}},
                                             {"type": s, s: s}]}]
    proxy.run(store.sync(namespace, sid, [prepare(m) for m in messages]))  # type: ignore[arg-type]
    proxy.run(store.add_record(namespace, sid, {
        "ts": 1_700_000_000_000, "kind": s, "reason": s, "tokens_before": s,
        "tokens_after": s, "model": s, "at_message": s}))
    proxy.run(store.add_internal(namespace, sid, s, {"before": [
        {"role": "assistant", "content": s}], "replace": None, "after": [], "note": s}))
    proxy.run(store.put_summary(namespace, sid, f"2:{s}", orjson.dumps(
        {"text": s, "summarizer": s, "latency_ms": s}).decode()))
    proxy.run(store.put_summary(namespace, sid, f"3:{s}", "late"))
    proxy.run(store.put_summary(namespace, sid, f"{OMIT}2:{s}", s))
    prefix = store.prefix(namespace, sid)
    proxy.run(store.client.hset(prefix + ":branches", "0", orjson.dumps(
        {"parent": s, "fork_at": s, "created": s})))
    # a request's point naming the model as the client wrote it (the list shows it, and
    # offers it as a filter)
    proxy.run(store.client.rpush(prefix + ":req", orjson.dumps(
        {"ts": 1_700_000_000_000, "client": 1200, "forwarded": 900, "model": s})))
    return sid


def pages(proxy: ProxyServer, strings: list[str], turns: str, namespace: str) -> list[str]:
    """Every inspector page about the stored data, and every parameter a page reflects."""
    c = httpx.Client(base_url=proxy.base, follow_redirects=False, timeout=60)
    login = c.post("/admin/ui/login", data={"key": ADMIN_KEY})
    assert login.status_code == 303
    out: list[str] = []

    def get(path: str, **query: str) -> None:
        r = c.get(path, params=query)
        assert r.status_code < 500, f"{path} {query}: {r.status_code} {r.text[:300]}"
        assert r.headers["content-type"].startswith("text/html"), (path, query)
        out.append(r.text)

    get("/admin/ui", tenant="acme")
    get("/admin/ui", tenant=namespace)
    get("/admin/ui", tenant="*", sort="model")
    get("/admin/ui/session", tenant="acme", id=turns)
    for pos in range(4 * len(strings) + 3):
        get("/admin/ui/message", tenant="acme", id=turns, pos=str(pos))
    for s in strings:
        sid = "n:" + s
        for tenant in ("acme", namespace):
            get("/admin/ui/session", tenant=tenant, id=sid)
            for pos in range(6):
                get("/admin/ui/message", tenant=tenant, id=sid, pos=str(pos))
        # reflected: a search, an unknown tenant, a session that is not there
        get("/admin/ui", tenant="acme", q=s)
        get("/admin/ui", tenant=namespace, model=s)
        get("/admin/ui", tenant="*", model=s, sort="model")
        get("/admin/ui", tenant=s)
        get("/admin/ui/session", tenant=s, id=sid)
        get("/admin/ui/session", tenant="acme", id=sid + "-gone")
        get("/admin/ui/message", tenant="acme", id=sid, pos="99")
    c.close()
    return out


@pytest.fixture
def inspector(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
              monkeypatch: pytest.MonkeyPatch) -> ProxyServer:
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    root = write_config(tmp_path / "cfg", upstream.url, acme_policy=(
        'max_run_loops = 4\nomit_batch = 2\nsummary_model = "extractive"\n'
        'soft_budget_tokens = 4000\nclear_at_least = 500\n'))
    return make_proxy(config_dir=str(root))  # type: ignore[no-any-return]


def render(proxy: ProxyServer, upstream: ScriptedUpstream, strings: list[str],
           tag: str) -> list[Page]:
    turns = f"turns-{tag}"
    converse(proxy, upstream, turns, strings)
    namespace = f"gone-{tag}"  # sessions of a tenant no longer configured
    for s in strings:
        store_directly(proxy, "acme", s)
        store_directly(proxy, namespace, s)
        store_directly(proxy, s, s)  # a namespace named so (the tenant list shows it)
    proxy.settle()
    return [Page(html) for html in pages(proxy, strings, "n:" + turns, namespace)]


def test_no_element_or_attribute_of_any_page_comes_from_stored_data(
        inspector: ProxyServer, upstream: ScriptedUpstream) -> None:
    """Planted on the sessions list, each red: a session's model shown unescaped, the
    filters' option labels unescaped (the model a client named is one)."""
    benign = render(inspector, upstream, [plain(s, k) for k, s in enumerate(CORPUS)], "plain")
    allowed = shape(benign)
    hostile = render(inspector, upstream, CORPUS, "hostile")
    found = {v for page in hostile for v in violations(page, allowed)}
    assert not found, "stored data became markup:\n" + "\n".join(sorted(found)[:30])
    # the sweep is worth something only if the pages show the data: each string is shown
    # whole, as text, on some page (a field dropped or escaped twice would not be)
    shown = "\n".join("".join(p.text) for p in hostile)
    missing = [s for s in CORPUS if text_form(s) not in shown]
    assert not missing, f"never shown as it is: {missing}"
    assert all(page.elements for page in hostile)


def text_form(s: str) -> str:
    """A string as a parser reads it back from an HTML text node (CR is newline there)."""
    return s.replace("\r\n", "\n").replace("\r", "\n")


# -- the pure parts: what counts as a violation -------------------------------------------------

LEGIT = ("<!doctype html><p class='muted'>x</p><a href='/admin/ui/session?id=a'>a</a>"
         "<form method='post' action='/admin/ui/compact'><input type='hidden' name='id' "
         "value='a'></form>")


@pytest.mark.parametrize(("html", "what"), [
    (LEGIT.replace("x</p>", "<img src=x onerror=alert(1)></p>"), "element <img>"),
    (LEGIT.replace("class='muted'", "class='muted' onclick='x'"), "attribute onclick"),
    (LEGIT.replace("class='muted'", "class='evil'"), "attribute value <p class='evil'>"),
    (LEGIT.replace("/admin/ui/session?id=a", "javascript:alert(1)"), "a link out"),
    (LEGIT.replace("/admin/ui/session?id=a", "//evil.example/admin/ui"), "a link out"),
    (LEGIT.replace("x</p>", "<!-- x --></p>"), "comment"),
    (LEGIT.replace("x</p>", "<![CDATA[x]]></p>"), "declaration"),
    (LEGIT.replace("x</p>", "<?php x ?></p>"), "processing instruction"),
])
def test_what_the_sweep_calls_markup_from_data(html: str, what: str) -> None:
    allowed = shape([Page(LEGIT)])
    assert not list(violations(Page(LEGIT), allowed))
    found = list(violations(Page(html), allowed))
    assert found and any(what in f for f in found), found

