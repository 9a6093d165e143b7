"""The real `openai` client against `rlstream gen --serve`: run by tests/integration/openai_endpoint.rs.

Each phase makes calls as an unmodified OpenAI client does, checks what came back (token ids,
log-probs and versions in every choice's `rlstream` object, equal to the episode the generator
recorded), and checks each refusal's status and OpenAI error body. Prints one JSON summary line;
exits non-zero with the failed check otherwise.

    openai_check.py --base http://127.0.0.1:PORT/v1 --model ID --phase calls|refusals|chat|load
        [--key KEY] [--expect-version V] [--metrics HOST:PORT] [--context N]
"""

import argparse
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

EPISODE = "X-Rlstream-Episode"


def fail(msg):
    print(f"FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def raw(base, path, body=None, key=None, method=None):
    """A request without the client: the status and the parsed JSON body."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rl(choice):
    """A choice's `rlstream` object (an extra field the client keeps as it came)."""
    extra = choice.model_extra or {}
    check("rlstream" in extra, f"a choice without `rlstream`: {choice}")
    return extra["rlstream"]


def whole(resp):
    """Token ids, log-probs and versions of each choice of a whole response."""
    out = []
    for c in sorted(resp.choices, key=lambda c: c.index):
        r = rl(c)
        n = len(r["token_ids"])
        check(len(r["logprobs"]) == n and len(r["versions"]) == n, f"ragged choice {r}")
        out.append({"prompt": r["prompt_token_ids"], "token_ids": r["token_ids"],
                    "logprobs": r["logprobs"], "versions": r["versions"],
                    "finish": c.finish_reason})
    return out


def streamed(stream, n):
    """The same, gathered from a stream's chunks; also the text and the last chunk's extras."""
    got = [{"prompt": None, "token_ids": [], "logprobs": [], "versions": [], "finish": None,
            "text": ""} for _ in range(n)]
    last = None
    for chunk in stream:
        if not chunk.choices:
            last = chunk
            continue
        for c in chunk.choices:
            r = rl(c)
            g = got[c.index]
            if "prompt_token_ids" in r:
                check(g["prompt"] is None, "the prompt's ids come once per choice")
                g["prompt"] = r["prompt_token_ids"]
            g["token_ids"] += r["token_ids"]
            g["logprobs"] += r["logprobs"]
            g["versions"] += r["versions"]
            delta = getattr(c, "delta", None)
            g["text"] += (delta.content or "") if delta is not None else (c.text or "")
            if c.finish_reason:
                g["finish"] = c.finish_reason
    for g in got:
        check(g["finish"] in ("stop", "length"), f"a choice never finished: {g}")
    return got, last


def same_as_recorded(base, key, episode, calls):
    """The episode's record holds exactly the calls as the client received them."""
    status, rec = raw(base, f"/rlstream/episodes/{episode}", key=key, method="GET")
    check(status == 200, f"episode {episode}: {status} {rec}")
    check(len(rec["calls"]) == len(calls), f"{len(rec['calls'])} recorded, {len(calls)} made")
    for i, (recorded, received) in enumerate(zip(rec["calls"], calls)):
        check(recorded["call"] == i, "calls are numbered in order")
        for c, g in zip(recorded["choices"], received):
            check(recorded["prompt_token_ids"] == g["prompt"], f"call {i}: prompt ids differ")
            for field in ("token_ids", "logprobs", "versions"):
                check(c[field] == g[field],
                      f"call {i} choice {c['index']}: {field} recorded {c[field]}, received {g[field]}")
            check(c["finish_reason"] == g["finish"], f"call {i}: finish differs")
    return len(calls)


def error_of(fn):
    """Runs `fn`, which must fail with an API error: (status, code)."""
    try:
        fn()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        return e.status_code, body.get("code")
    fail(f"{fn} did not fail")


def phase_calls(client, a):
    ep = f"ep-{a.phase}-{time.time_ns()}"
    headers = {EPISODE: ep}
    models = [m.id for m in client.models.list().data]
    check(models == [a.model], f"models {models}")
    calls = []
    r = client.completions.create(model=a.model, prompt="12+3=", n=2, max_tokens=6, logprobs=0,
                                  extra_headers=headers)
    got = whole(r)
    check(len(got) == 2, "n=2 gives two choices")
    for c, g in zip(sorted(r.choices, key=lambda c: c.index), got):
        check(c.logprobs.token_logprobs == g["logprobs"], "OpenAI's logprobs are rlstream's")
    check(r.usage.prompt_tokens == len(got[0]["prompt"]), "usage counts the prompt")
    calls.append(got)
    prompt_ids = got[0]["prompt"]
    s = client.completions.create(model=a.model, prompt=prompt_ids, max_tokens=6, stream=True,
                                  stream_options={"include_usage": True}, extra_headers=headers)
    got, last = streamed(s, 1)
    check(got[0]["prompt"] == prompt_ids, "a token-id prompt is decoded as given")
    check(last is not None and last.usage.completion_tokens == len(got[0]["token_ids"]),
          "the last chunk carries the usage")
    check((last.model_extra or {}).get("rlstream", {}).get("episode") == ep, "recorded note")
    calls.append(got)
    versions = {v for call in calls for g in call for v in g["versions"]}
    if a.expect_version is not None:
        check(versions == {a.expect_version}, f"versions {versions}, expected {a.expect_version}")
    # Not recorded: any temperature, greedy included.
    g = client.completions.create(model=a.model, prompt="7+1=", max_tokens=4, temperature=0)
    check(all(lp == 0.0 for lp in rl(g.choices[0])["logprobs"]), "greedy tokens have log-prob 0")
    stops = check_stop(client, a)
    n = same_as_recorded(a.base, a.key, ep, calls)
    alts = completion_alternatives(client, a)
    return {"episode": ep, "calls": n, "versions": sorted(versions), "stop": stops,
            "alternatives": alts}


def completion_alternatives(client, a):
    """`logprobs: N` lists up to N alternatives per token, whole and streamed: a
    text-to-log-prob object per token (of two ids with one text, the likelier). Seeded calls
    until one has at least two tokens (a draw may stop at the first)."""
    listed = tokens = 0
    for seed in range(8):
        whole_r = client.completions.create(model=a.model, prompt="12+3=", max_tokens=6,
                                            logprobs=5, seed=seed)
        lp = whole_r.choices[0].logprobs
        for i, (text, own, top) in enumerate(zip(lp.tokens, lp.token_logprobs,
                                                 lp.top_logprobs)):
            values = sorted(top.values(), reverse=True)
            check(1 <= len(values) <= 5, f"token {i}: {len(values)} alternatives of 5 asked")
            check(sum(math.exp(v) for v in values) <= 1 + 1e-5,
                  f"token {i}: more than all the mass")
            if text in top:
                check(top[text] >= own,
                      f"token {i}: the drawn token's log-prob {own} vs {top[text]}")
            listed += len(values)
        tokens = max(tokens, len(lp.tokens))
        if tokens >= 2:
            break
    s = client.completions.create(model=a.model, prompt="12+3=", max_tokens=6, logprobs=3,
                                  stream=True)
    chunks = 0
    for chunk in s:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.tokens:
                check(all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs), "streamed alternatives")
                chunks += 1
    check(chunks >= 1, "no streamed chunk listed alternatives")
    return {"listed": listed, "streamed_chunks": chunks}


def check_stop(client, a):
    """A stop string ends the text before it, on the token that completed it, whole and
    streamed (greedy, so the calls without and with the stop string sample alike)."""
    greedy = dict(model=a.model, prompt="12*3=", max_tokens=8, temperature=0)
    full = client.completions.create(**greedy)
    text, ids = full.choices[0].text, rl(full.choices[0])["token_ids"]
    check(len(text) >= 1, f"the greedy completion has no text to stop on: {ids}")
    stop = text[-1]
    cut = text.index(stop)
    r = client.completions.create(**greedy, stop=[stop])
    got = rl(r.choices[0])["token_ids"]
    check(r.choices[0].text == text[:cut], f"stopped text {r.choices[0].text!r} of {text!r}")
    check(r.choices[0].finish_reason == "stop", "a stop string is finish `stop`")
    check(got == ids[:len(got)] and len(got) >= 1, f"stopped ids {got} of {ids}")
    s, _ = streamed(client.completions.create(**greedy, stop=[stop], stream=True), 1)
    check(s[0]["text"] == text[:cut] and s[0]["token_ids"] == got, f"streamed stop: {s}")
    return {"text": text, "stop": stop, "tokens": len(got)}


def phase_refusals(client, a):
    base, key = a.base, a.key
    out = {}
    ok = {"model": a.model, "prompt": "1+1=", "max_tokens": 2}
    out["no_key"] = raw(base, "/completions", ok)[0]
    out["models_no_key"] = raw(base, "/models", method="GET")[0]
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    out["wrong_key"] = error_of(lambda: wrong.completions.create(model=a.model, prompt="1", max_tokens=1))
    status, body = raw(base, "/completions", b"{\"model\": ", key=key)
    out["malformed"] = (status, body["error"]["code"])
    out["unknown_model"] = error_of(lambda: client.completions.create(model="gpt-4", prompt="1"))
    long = "1" * (a.context + 5)
    out["past_context"] = error_of(lambda: client.completions.create(model=a.model, prompt=long))
    out["max_tokens_past_context"] = error_of(
        lambda: client.completions.create(model=a.model, prompt="1", max_tokens=a.context * 2))
    out["ids_past_vocab"] = error_of(
        lambda: client.completions.create(model=a.model, prompt=[1, 10_000_000], max_tokens=1))
    out["unsupported"] = error_of(
        lambda: client.completions.create(model=a.model, prompt="1", presence_penalty=0.5))
    out["too_many_alternatives"] = error_of(
        lambda: client.completions.create(model=a.model, prompt="1", logprobs=21))
    out["not_trainable"] = error_of(lambda: client.completions.create(
        model=a.model, prompt="1", temperature=0, extra_headers={EPISODE: "ep-greedy"}))
    out["no_template"] = error_of(lambda: client.chat.completions.create(
        model=a.model, messages=[{"role": "user", "content": "hi"}]))
    out["bad_n"] = error_of(lambda: client.completions.create(model=a.model, prompt="1", n=0))
    status, body = raw(base, "/nowhere", ok, key=key)
    out["unknown_route"] = (status, body["error"]["code"])
    # Every refusal is an OpenAI error body, and the generator still serves.
    r = client.completions.create(model=a.model, prompt="1+1=", max_tokens=2)
    check(r.choices[0].finish_reason in ("stop", "length"), "served after the refusals")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def phase_chat(client, a):
    ep = f"ep-chat-{time.time_ns()}"
    headers = {EPISODE: ep}
    messages = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 2+2? Answer in one word."}]
    calls = []
    r = client.chat.completions.create(model=a.model, messages=messages, n=2, max_tokens=8,
                                       logprobs=True, extra_headers=headers)
    got = whole(r)
    for c, g in zip(sorted(r.choices, key=lambda c: c.index), got):
        check(c.message.role == "assistant", "an assistant message")
        check([t.logprob for t in c.logprobs.content] == g["logprobs"], "chat logprobs")
    calls.append(got)
    s = client.chat.completions.create(model=a.model, messages=messages, max_tokens=8, stream=True,
                                       logprobs=True, extra_headers=headers,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    got, _ = streamed(s, 1)
    calls.append(got)
    alts = chat_alternatives(client, a, messages, headers, calls)
    same_as_recorded(a.base, a.key, ep, calls)
    return {"episode": ep, "prompt": calls[0][0]["prompt"], "calls": len(calls),
            "chat_prompt_no_thinking": calls[1][0]["prompt"], "alternatives": alts}


def chat_alternatives(client, a, messages, headers, calls):
    """`top_logprobs` against the distribution each token was drawn from: with top_k 3
    every kept id is listed, so the three alternatives hold all the recorded distribution's
    mass, likeliest first, and the drawn token is among them with its recorded log-prob."""
    def checked(content, asked):
        for i, t in enumerate(content):
            top = t.top_logprobs
            check(len(top) == min(3, asked), f"token {i}: {len(top)} alternatives")
            values = [x.logprob for x in top]
            check(values == sorted(values, reverse=True), f"token {i}: not likeliest first")
            if asked >= 3:
                mass = sum(math.exp(v) for v in values)
                check(abs(mass - 1) < 1e-5, f"token {i}: the kept ids hold {mass} of the mass")
                check(any(x.token == t.token and x.logprob == t.logprob for x in top),
                      f"token {i}: the drawn token {t.token!r} is not listed with its log-prob")
        return len(content)
    r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=6,
                                       logprobs=True, top_logprobs=5, extra_body={"top_k": 3},
                                       extra_headers=headers)
    got = whole(r)
    check(got[0]["logprobs"] == [t.logprob for t in r.choices[0].logprobs.content],
          "the listed log-probs are the recorded ones")
    calls.append(got)
    tokens = checked(r.choices[0].logprobs.content, 5)
    s = client.chat.completions.create(model=a.model, messages=messages, max_tokens=6,
                                       logprobs=True, top_logprobs=2, stream=True,
                                       extra_body={"top_k": 3})
    streamed_tokens = 0
    for chunk in s:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed_tokens += checked(c.logprobs.content, 2)
    check(streamed_tokens >= 1, "no streamed token listed alternatives")
    bad = error_of(lambda: client.chat.completions.create(
        model=a.model, messages=messages, max_tokens=2, top_logprobs=2))
    check(bad == (400, "invalid_value"), f"top_logprobs without logprobs: {bad}")
    return {"tokens": tokens, "streamed_tokens": streamed_tokens}


def phase_load(client, a):
    """More requests than --serve-max-requests at once, and a client that leaves mid-stream."""
    results = []

    def one():
        try:
            s = client.completions.create(model=a.model, prompt="Hello", max_tokens=48,
                                          stream=True)
            for _ in s:
                pass
            results.append(200)
        except openai.RateLimitError as e:
            results.append((429, e.body.get("code") if isinstance(e.body, dict) else None))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    busy = [r for r in results if r != 200]
    check(results.count(200) >= 1, f"no request was served: {results}")
    check(busy and all(r == (429, "too_many_requests") for r in busy), f"no 429: {results}")
    # Leaves after the first chunk of a long stream: the call's rows must be freed.
    s = client.completions.create(model=a.model, prompt="Hello", n=4,
                                  max_tokens=a.context - 16, stream=True)
    next(iter(s))
    s.close()
    deadline = time.time() + 20
    rows = None
    while time.time() < deadline:
        with urllib.request.urlopen(f"http://{a.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        rows = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("rlstream_serve_rows")]
        gone = [l for l in text.splitlines()
                if l.startswith("rlstream_serve_requests_total") and 'outcome="disconnected"' in l]
        if rows == [0.0] and gone:
            break
        time.sleep(0.1)
    check(rows == [0.0], f"rows still held after the client left: {rows}")
    check(gone, "the client that left was not counted")
    r = client.completions.create(model=a.model, prompt="Hello", max_tokens=2)
    check(r.choices[0].finish_reason in ("stop", "length"), "served after the client left")
    return {"served": results.count(200), "too_many": len(busy)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--phase", required=True, choices=["calls", "refusals", "chat", "load"])
    p.add_argument("--key", default="none")
    p.add_argument("--expect-version", type=int)
    p.add_argument("--metrics")
    p.add_argument("--context", type=int, default=128)
    a = p.parse_args()
    client = openai.OpenAI(base_url=a.base, api_key=a.key, max_retries=0, timeout=120)
    phase = {"calls": phase_calls, "refusals": phase_refusals, "chat": phase_chat,
             "load": phase_load}[a.phase]
    print(json.dumps(phase(client, a)))


if __name__ == "__main__":
    main()
