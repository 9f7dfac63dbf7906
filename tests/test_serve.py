"""Lesson 9's server over HTTP on 127.0.0.1 (a free port, never a fixed one): the OpenAI protocol, streaming,
bad requests, disconnects, metrics, cache_salt; the tiny seeded model and an offline tokenizer (no downloads).
Every server is stopped by its fixture; every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from pagedkv.benchmarks.serve import parse_metrics
from pagedkv.engine import LLM, SamplingParams
from pagedkv.entrypoints.api_server import bind_socket, build_app, build_engine, describe_kv_pool
from pagedkv.entrypoints.cli_args import make_arg_parser
from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer

MAX_MODEL_LEN = 256
BLOCKS = 64
BLOCK_SIZE = 16


@contextlib.contextmanager
def serving(*flags: str) -> Iterator[SimpleNamespace]:
    """``pagedkv serve tiny`` in a thread of this process on 127.0.0.1:<free port>; stopped on exit."""
    import uvicorn

    args = make_arg_parser().parse_args(["tiny", "--port", "0", "--num-gpu-blocks", str(BLOCKS), "--max-model-len",
                                         str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), *flags])
    engine, names = build_engine(args)
    app = build_app(engine, names, "tiny", args.enable_prompt_tokens_details)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as client:
            yield SimpleNamespace(base=base, client=client, engine=engine, llm=engine.llm)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server thread did not stop"


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    with serving("--enable-prompt-tokens-details") as s:
        yield s


def idle(s: SimpleNamespace, timeout: float = 30.0) -> dict:
    """Wait (bounded) until the server runs nothing and holds no blocks; return its snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snap = s.client.get("/pagedkv/snapshot").json()
        if not snap["running"] and not snap["waiting"] and not snap["block_tables"]:
            return snap
        assert time.monotonic() < deadline, f"the server still holds requests: {snap['block_tables']}"
        time.sleep(0.05)


def completion(s: SimpleNamespace, **body) -> dict:
    r = s.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(text: str) -> list:
    """The data of each server-sent event; the last must be ``[DONE]``."""
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


PROMPTS = [[5, 17, 300, 42, 8, 8, 9], list(range(40, 75)), [1], list(range(100, 118))]


def test_health_models_and_metrics_names(srv):
    assert srv.client.get("/health").status_code == 200
    models = srv.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    completion(srv, prompt=[1, 2, 3], max_tokens=3)
    text = srv.client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        assert name in text, name
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}' in text


def test_greedy_over_http_equals_offline_generate(srv):
    """The same tiny model, pool and block size offline: token for token the same greedy completions."""
    llm = LLM(tiny_model(0), num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    body = completion(srv, prompt=PROMPTS, max_tokens=12, temperature=0, return_token_ids=True)
    assert [c["token_ids"] for c in body["choices"]] == [o.outputs[0].token_ids for o in offline]
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * len(PROMPTS)
    tok = tiny_tokenizer()
    assert body["choices"][0]["text"] == tok.decode(offline[0].outputs[0].token_ids, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    assert body["usage"]["completion_tokens"] == 12 * len(PROMPTS)
    idle(srv)


def test_sixteen_concurrent_streams(srv):
    """16 streams at once, each a different prompt: every one ends in [DONE] with the non-streamed greedy tokens,
    and the server ran several of them in one batch."""
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(16)]
    expected = completion(srv, prompt=prompts, max_tokens=20, temperature=0, return_token_ids=True)["choices"]

    async def go():
        async with httpx.AsyncClient(base_url=srv.base, timeout=120) as c:
            async def one(p):
                r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 20, "temperature": 0,
                                                          "stream": True, "return_token_ids": True,
                                                          "stream_options": {"include_usage": True}})
                return r.status_code, r.text
            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(go())
    for (status, text), exp in zip(results, expected, strict=True):
        assert status == 200
        events = sse(text)
        tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
        assert tokens == exp["token_ids"]
        assert "".join(c["text"] for e in events for c in e["choices"]) == exp["text"]
        assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20
    m = srv.client.get("/metrics").text
    assert "vllm:num_preemptions_total" in m
    idle(srv)


#: A 400 whose param must be null: vLLM 0.26 reports a plain ValueError (most of SamplingParams' checks) with no
#: param (``create_error_response``, ``vllm/entrypoints/serve/utils/error_response.py``); only a
#: ``VLLMValidationError`` names its field.
NULL = "<null>"

BAD = [
    (b"{not json", 400, None),
    (b'{"prompt": "hi", "max_tokens": "many"}', 400, "body.max_tokens"),
    (b'{"prompt": "hi", "temperature": "hot"}', 400, "body.temperature"),
    (b'{"prompt": [1, -3]}', 400, None),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "n": 0}', 400, NULL),
    (b'{"prompt": "hi", "temperature": 3.5}', 400, "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "hi", "top_k": -5}', 400, NULL),
    (b'{"prompt": [600, 1]}', 400, None),  # vLLM 0.26: a plain ValueError, no param (test below)
    (b'{"prompt": "hi", "stop_token_ids": [100000]}', 400, "stop_token_ids"),
    (b'{"prompt": ""}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{}', 400, "prompt"),
    (json.dumps({"prompt": [3] * MAX_MODEL_LEN}).encode(), 400, "input_tokens"),
    (json.dumps({"prompt": [3] * 10, "max_tokens": MAX_MODEL_LEN}).encode(), 400, "input_tokens"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    (b'{"prompt": "hi", "logprobs": -1}', 400, "logprobs"),  # vLLM: "`logprobs` must be a positive value."
    (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),  # more than max_logprobs (20)
    (b'{"prompt": "hi", "stop": [""]}', 400, "stop"),
    (b'[1, 2]', 400, None),
    (b'{"prompt": "hi", "cache_salt": ""}', 400, "cache_salt"),
    # vLLM 0.26's own refusals, with its param (the lab served these, or named another field)
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    (json.dumps({"prompt": [3] * 10, "max_tokens": MAX_MODEL_LEN + 1}).encode(), 400, "max_tokens"),
    (b'{"prompt": "hi", "n": 2, "temperature": 0}', 400, NULL),
    (b'{"prompt": "hi", "n": 16385}', 400, NULL),
    (b'{"prompt": "hi", "stop": 5}', 400, "body.stop"),
    (json.dumps({"prompt": [[1]] * 1025}).encode(), 400, "prompt"),
    # what the lab's engine cannot serve is refused, not ignored
    (b'{"prompt": "hi", "min_tokens": 4, "max_tokens": 3}', 400, NULL),
    (b'{"prompt": "hi", "min_p": 2}', 400, NULL),
    (b'{"prompt": "hi", "frequency_penalty": 3}', 400, NULL),
    (b'{"prompt": "hi", "repetition_penalty": 0}', 400, NULL),
    (b'{"prompt": "hi", "logit_bias": {"x": 10}}', 400, "logit_bias"),  # vLLM: keys that are not token ids
    (b'{"prompt": "hi", "logit_bias": {"600": 10}}', 400, "logit_bias"),  # outside the vocabulary
    (b'{"prompt": "hi", "allowed_token_ids": []}', 400, "allowed_token_ids"),
    (b'{"prompt": "hi", "bad_words": ["a", ""]}', 400, NULL),  # vLLM: a plain ValueError
    (b'{"prompt": "hi", "bad_words": null}', 400, "body.bad_words"),  # vLLM's field is a list, not optional
    (b'{"prompt": "hi", "prompt_logprobs": 1, "stream": true}', 400, "prompt_logprobs"),  # vLLM's words too
    (b'{"prompt": "hi", "prompt_logprobs": true, "stream": true}', 400, "prompt_logprobs"),  # true is 1
    (b'{"prompt": "hi", "prompt_logprobs": -2}', 400, "prompt_logprobs"),
    (b'{"prompt": "hi", "prompt_logprobs": 21}', 400, "prompt_logprobs"),  # more than max_logprobs (20)
    (b'{"prompt": "hi", "logprobs": 1, "logprob_token_ids": [5]}', 400, "logprob_token_ids"),
    (b'{"prompt": "hi", "skip_special_tokens": false}', 400, "skip_special_tokens"),
    (b'{"prompt": "hi", "suffix": ""}', 400, "suffix"),  # vLLM: "suffix is not currently supported"
    (json.dumps({"prompt": [600] * MAX_MODEL_LEN}).encode(), 400, "input_tokens"),  # vLLM: the length first
    (b'{"prompt": "hi", "response_format": {"type": "json_object"}}', 400, "response_format"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[b[0][:40].decode() for b in BAD])
def test_bad_requests_get_openai_errors_and_change_nothing(srv, body, status, param):
    r = srv.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == (None if param == NULL else param), err
    assert srv.client.get("/health").status_code == 200
    assert idle(srv)["block_tables"] == {}


def test_a_token_out_of_the_vocabulary_gets_vllms_words_and_no_param(srv):
    """``InputProcessor._validate_model_input`` (vllm/v1/engine/input_processor.py) raises a plain ValueError,
    which vLLM 0.26's ``create_error_response`` turns into a 400 without a param."""
    r = srv.client.post("/v1/completions", json={"prompt": [600, 1, 9999]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == "Token id 9999 is out of vocabulary" and err["param"] is None, err
    assert err["type"] == "BadRequestError" and idle(srv)["block_tables"] == {}


def test_bad_chat_requests(srv):
    hi = [{"role": "user", "content": "hi"}]
    for body, status, param in (
            ({"messages": []}, 400, None), ({"messages": "hi"}, 400, None), ({"model": "x", "messages": hi}, 404, None),
            ({"messages": [{"content": "no role"}]}, 400, None),
            ({"messages": hi, "stream_options": {"include_usage": True}}, 400, "stream_options"),
            ({"messages": hi, "max_completion_tokens": MAX_MODEL_LEN + 1}, 400, "max_completion_tokens"),
            ({"messages": hi, "max_tokens": MAX_MODEL_LEN + 1}, 400, "max_tokens"),
            ({"messages": hi, "n": 3, "temperature": 0.0}, 400, NULL),
            ({"messages": hi, "continue_final_message": True, "add_generation_prompt": True}, 400, None),
            ({"messages": hi, "continue_final_message": True}, 400, None),  # the template refuses the pair
            ({"messages": hi, "top_logprobs": 2}, 400, "top_logprobs"),  # vLLM: needs logprobs: true
            ({"messages": hi, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
            ({"messages": hi, "logprobs": True, "top_logprobs": -2}, 400, "top_logprobs"),
            ({"messages": hi, "logprobs": True, "top_logprobs": -1}, 400, "logprobs"),  # the vocabulary > 20
            ({"messages": hi, "chat_template": "{{ 'x' }}"}, 400, None),  # vLLM: untrusted without a flag
            ({"messages": hi, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, 400, None),
            # chat without max_tokens: the room left; none left is vLLM's "max_tokens must be at least 1, got 0."
            ({"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN - 19)}]}, 400, "max_tokens"),  # 256 tok
            ({"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, 400, "input_tokens")):
        r = srv.client.post("/v1/chat/completions", json=body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["code"] == status
        if param is not None:
            assert r.json()["error"]["param"] == (None if param == NULL else param), (body, r.text)
    assert srv.client.get("/nope").status_code == 404
    assert srv.client.get("/nope").json()["error"]["code"] == 404


def test_vllm_wire_format_of_chunks_ids_and_defaults(srv):
    """What vLLM 0.26 sends, field for field, where the lab differed: ``"max_tokens": null`` is the default 16
    (``CompletionRequest.normalize_null_max_tokens``; the lab ran to ``max_model_len``); every stream chunk has
    ``object`` and ``logprobs`` and, with ``return_token_ids``, the prompt's ids on a choice's first chunk
    (``completion_stream_generator``, ``chat_completion_stream_generator``); the usage chunk drops its nulls;
    chat answers ``return_token_ids`` too; ``continue_final_message`` renders the last message open."""
    assert completion(srv, prompt=[1, 2, 3], max_tokens=None)["usage"]["completion_tokens"] == 16
    body = completion(srv, prompt=[[4, 5, 6], [7, 8]], max_tokens=3, temperature=0, return_token_ids=True)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[4, 5, 6], [7, 8]]
    plain = completion(srv, prompt=[4, 5, 6], max_tokens=3, temperature=0)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None and plain["logprobs"] is None
    r = srv.client.post("/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": 3, "temperature": 0,
                                                 "stream": True, "return_token_ids": True,
                                                 "stream_options": {"include_usage": True}})
    events = sse(r.text)
    assert all(e["object"] == "text_completion" for e in events)
    assert all("logprobs" in e["choices"][0] and e["choices"][0]["logprobs"] is None for e in events[:-1])
    assert events[0]["choices"][0]["prompt_token_ids"] == [4, 5, 6]
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:-1])
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == body["choices"][0]["token_ids"]
    assert events[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3,
                                   "prompt_tokens_details": {"cached_tokens": 0}}  # the fixture enables details
    assert events[-1]["choices"] == [] and events[-1]["object"] == "text_completion"
    hi = [{"role": "user", "content": "hi"}]
    chat = srv.client.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 3, "temperature": 0,
                                                         "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 3
    r = srv.client.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 3, "temperature": 0,
                                                      "stream": True, "return_token_ids": True})
    events = sse(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]
    assert "stop_reason" not in events[1]["choices"][0] and "stop_reason" in events[-1]["choices"][0]
    open_ = srv.client.post("/v1/chat/completions", json={
        "messages": [*hi, {"role": "assistant", "content": "Once upon"}], "max_tokens": 2, "temperature": 0,
        "continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}).json()
    text = tiny_tokenizer().decode(open_["prompt_token_ids"])
    assert text.endswith("<|assistant|>Once upon"), text
    idle(srv)


def test_continuous_usage_stats(srv):
    """``stream_options.continuous_usage_stats`` (with ``include_usage``) puts usage on every chunk: the prompt's
    tokens and the choice's tokens so far (0 on chat's role chunk), as vLLM 0.26's stream generators; the lab
    ignored it. Without ``include_usage`` it does nothing (``should_include_usage``)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    r = srv.client.post("/v1/completions", json={"prompt": [[4, 5, 6], [7, 8]], "max_tokens": 3, "temperature": 0,
                                                 "stream": True, "stream_options": opts})
    events = sse(r.text)
    seen = {0: 0, 1: 0}
    for e in events[:-1]:
        i = e["choices"][0]["index"]
        seen[i] += 1
        plen = [3, 2][i]
        assert e["usage"] == {"prompt_tokens": plen, "completion_tokens": seen[i], "total_tokens": plen + seen[i]}
    assert events[-1]["usage"]["completion_tokens"] == 6
    hi = [{"role": "user", "content": "hi"}]
    events = sse(srv.client.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2, "temperature": 0,
                                                               "stream": True, "stream_options": opts}).text)
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 2]
    events = sse(srv.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True,
                                                          "stream_options": {"continuous_usage_stats": True}}).text)
    assert all("usage" not in e for e in events)
    idle(srv)


def test_add_special_tokens_as_vllm():
    """``add_special_tokens`` (vLLM 0.26: True for completions, False for chat, where the template has them) is
    passed to the tokenizer; the lab ignored it. The tiny tokenizer adds nothing, so a tokenizer that adds a BOS
    stands in: a served prompt is one token longer with it."""
    from pagedkv.entrypoints.api_server import OpenAIServing
    from pagedkv.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    class BOS:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, continue_final_message, **kwargs):
            return "".join(m["content"] for m in messages)

    serving = OpenAIServing(SimpleNamespace(tokenizer=BOS()), ["m"], "m")
    assert serving.render_completion(CompletionRequest(prompt="ab")) == [[1, 97, 98]]
    assert serving.render_completion(CompletionRequest(prompt=["ab"], add_special_tokens=False)) == [[97, 98]]
    hi = [{"role": "user", "content": "ab"}]
    assert serving.render_chat(ChatCompletionRequest(messages=hi)) == [97, 98]
    assert serving.render_chat(ChatCompletionRequest(messages=hi, add_special_tokens=True)) == [1, 97, 98]


def test_echo_as_vllm(srv):
    """``echo`` (the lab refused it) as vLLM 0.26's ``OpenAIServingCompletion``: the text starts with the prompt
    (as sent, or its ids decoded); with ``return_token_ids`` no prompt text, and the ids start with the prompt's;
    ``max_tokens`` 0 shows the prompt alone (one token is generated and counted in usage:
    ``echo_without_generation``); a stream's first chunk carries the prompt and its ids. Chat's echo is refused."""
    tok = tiny_tokenizer()
    plain = completion(srv, prompt="Hello", max_tokens=4, temperature=0, return_token_ids=True)["choices"][0]
    body = completion(srv, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert body["choices"][0]["text"] == "Hello" + plain["text"] and body["usage"]["completion_tokens"] == 4
    ids = completion(srv, prompt="Hello", max_tokens=4, temperature=0, echo=True, return_token_ids=True)["choices"][0]
    assert ids["text"] == plain["text"] and ids["token_ids"] == plain["prompt_token_ids"] + plain["token_ids"]
    only = completion(srv, prompt="Hello", max_tokens=0, echo=True)
    assert only["choices"][0]["text"] == "Hello" and only["choices"][0]["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 1
    toks = completion(srv, prompt=[[5, 6, 7], [9, 10]], max_tokens=3, temperature=0, echo=True)["choices"]
    assert [c["text"][:len(tok.decode(p))] for c, p in zip(toks, [[5, 6, 7], [9, 10]], strict=True)] == [
        tok.decode([5, 6, 7]), tok.decode([9, 10])]
    r = srv.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "echo": True,
                                                 "stream": True})
    events = sse(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]
    assert events[0]["choices"][0]["text"].startswith("Hello")
    assert events[0]["choices"][0]["prompt_token_ids"] == plain["prompt_token_ids"]
    r = srv.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    idle(srv)


def test_clients_may_reuse_a_request_id_and_must_send_json(srv):
    """vLLM 0.26 adds 8 random characters to the caller's ``request_id`` (``InputProcessor.assign_request_id``),
    so concurrent requests with one id all run; the lab answered the second with 400 "already in use" (an error
    event when streamed). A body that is not ``application/json`` is a 400 (``validate_json_request``)."""
    body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "request_id": "same"}

    async def go():
        async with httpx.AsyncClient(base_url=srv.base, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={**body, "stream": stream})
                                          for stream in (False, False, True, True)))

    results = asyncio.run(go())
    assert [r.status_code for r in results] == [200] * 4
    assert [r.json()["id"] for r in results[:2]] == ["cmpl-same"] * 2
    texts = [r.json()["choices"][0]["text"] for r in results[:2]]
    texts += ["".join(c["text"] for e in sse(r.text) for c in e["choices"]) for r in results[2:]]
    assert len(set(texts)) == 1
    r = srv.client.post("/v1/completions", content=b'{"prompt": [1], "max_tokens": 2}',
                        headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]
    idle(srv)


def test_an_error_after_the_200_is_the_error_body_then_done(srv, monkeypatch):
    """A streamed request that fails once its 200 is sent gets one error event with the body a non-streamed
    error would have (type ``BadRequestError`` and its param for a refused request; ``InternalServerError``, 500
    for a bug), then ``[DONE]``, as vLLM's ``completion_stream_generator`` (``except Exception``). The lab sent
    the exception's class name as the type, no param, and for a bug broke the stream without ``[DONE]``."""
    from pagedkv.engine.async_llm import InvalidRequestError

    for exc, expected in ((InvalidRequestError("refused late", "prompt"), ("BadRequestError", 400, "prompt")),
                          (RuntimeError("a bug"), ("InternalServerError", 500, None))):
        async def failing(*args, exc=exc, **kwargs):
            raise exc
            yield  # an async generator, as AsyncLLM.generate

        monkeypatch.setattr(srv.engine, "generate", failing)
        r = srv.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True})
        assert r.status_code == 200
        (event,) = sse(r.text)
        err = event["error"]
        assert (err["type"], err["code"], err["param"]) == expected and err["message"] == str(exc)
    monkeypatch.undo()
    assert completion(srv, prompt=[1, 2], max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_disconnects_abort_and_free_blocks(srv):
    """A streaming client that goes away after two chunks, and a non-streaming one that times out: both requests
    are aborted, their blocks return to the pool, and the server answers the next request."""
    with httpx.Client(base_url=srv.base, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": list(range(1, 60)), "max_tokens": 190,
                                                      "stream": True}) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break
    # the connection is closed: the engine must drop the request
    idle(srv)
    # the read limit is far below the request's own time (190 decode steps, about 0.3 s on a fast quiet CPU, more
    # under load), and the body is sent in full first: the server always has the request when the client leaves
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.base}/v1/completions", json={"prompt": list(range(1, 60)), "max_tokens": 190},
                   timeout=httpx.Timeout(10.0, read=0.03))
    snap = idle(srv)
    assert len(snap["free_queue"]) == BLOCKS - 1
    gauges = parse_metrics(srv.client.get("/metrics").text)
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:kv_cache_usage_perc"] == 0
    assert completion(srv, prompt=[1, 2], max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_an_abort_updates_the_gauges_before_a_step_in_flight_returns(small_llm):
    """With async scheduling a step may still be in flight when an abort is applied: the blocks are free at once
    (a snapshot shows them free), and the gauges must say so at once too. They were recorded only after the next
    step returned, so ``/metrics`` read right after an idle snapshot could still count the aborted request (the
    disconnect test failed that way once on a busy machine)."""
    from pagedkv.engine.async_llm import AsyncLLM, EngineCoreRequest
    from pagedkv.engine.output_processor import RequestState

    engine = AsyncLLM(small_llm, "tiny")  # its loop is not started: the test drives it by hand
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    engine._states["r"] = RequestState("r", 0, [5, 6, 7], sp, [], False, None)
    engine._pending.append(("add", EngineCoreRequest("r", [5, 6, 7], sp, 20)))
    engine._apply_pending()
    engine.core.step()  # launches the first step and returns at once: it is in flight
    assert engine.core.core.batch_queue
    engine._record_scheduler_stats()
    gauges = parse_metrics(engine.stat_logger.render().decode())
    assert gauges["vllm:num_requests_running"] == 1 and gauges["vllm:kv_cache_usage_perc"] > 0
    engine._pending.append(("abort", ["r"]))
    engine._apply_pending()
    assert engine.core.core.batch_queue  # still in flight
    gauges = parse_metrics(engine.stat_logger.render().decode())
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:kv_cache_usage_perc"] == 0
    while engine.core.has_unfinished_requests():  # drain the step in flight
        engine.core.step()


def test_openai_client_completions_chat_and_stream(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="Hello, world!", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hello")


def test_sampling_parameters_n_seed_and_stop(srv):
    body = dict(prompt=[9, 8, 7], max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, n=3,
                return_token_ids=True)
    a, b = completion(srv, **body), completion(srv, **body)
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]  # seeded
    assert [c["index"] for c in a["choices"]] == [0, 1, 2] and a["usage"]["completion_tokens"] == 30
    greedy = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0)["choices"][0]["text"]
    stop = greedy[3:5]
    assert stop
    cut = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == greedy[: greedy.index(stop)]
    ids = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0, return_token_ids=True)["choices"][0]
    stopped = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0, stop_token_ids=[ids["token_ids"][2]],
                         return_token_ids=True)["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == ids["token_ids"][:3]
    tok = tiny_tokenizer()  # the stop token's text is not in the output (vLLM's detokenizer skips it)
    assert stopped["text"] == tok.decode(ids["token_ids"][:2], skip_special_tokens=True)
    r = srv.client.post("/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 10, "temperature": 0,
                                                 "stop_token_ids": [ids["token_ids"][2]], "stream": True})
    assert "".join(c["text"] for e in sse(r.text) for c in e["choices"]) == stopped["text"]
    idle(srv)


def test_min_tokens_min_p_penalties_and_logit_bias_are_served(srv):
    """vLLM's ``min_tokens``, ``min_p``, penalty, ``logit_bias`` and ``allowed_token_ids`` fields reach the
    sampler: the answers are offline ``generate``'s with the same parameters (the stop token masked for the first
    5 tokens; ``min_p=1`` leaves only the likeliest token; a bias of 100 forces its token)."""
    greedy = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0, return_token_ids=True)["choices"][0]
    stop = greedy["token_ids"][1]
    got = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0, stop_token_ids=[stop], min_tokens=5,
                     return_token_ids=True)["choices"][0]
    llm = LLM(tiny_model(0), num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    want = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop],
                                                    min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert got["token_ids"] == want.token_ids and stop not in got["token_ids"][:5]
    assert got["token_ids"] != greedy["token_ids"][:2]
    sampled = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=1.0, min_p=1.0, return_token_ids=True)
    assert sampled["choices"][0]["token_ids"] == greedy["token_ids"]
    penalties = dict(repetition_penalty=0.5, frequency_penalty=0.7, presence_penalty=-2.0)  # repeats rewarded
    got = completion(srv, prompt=[9, 8, 7], max_tokens=10, temperature=0, return_token_ids=True, **penalties)
    want = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=0.0, **penalties),
                        use_tqdm=False)[0].outputs[0]
    assert got["choices"][0]["token_ids"] == want.token_ids != greedy["token_ids"]
    forced = completion(srv, prompt=[9, 8, 7], max_tokens=5, temperature=0, logit_bias={"5": 1000},  # clamped: 100
                        return_token_ids=True)["choices"][0]["token_ids"]
    assert forced == [5] * 5
    kept = completion(srv, prompt=[9, 8, 7], max_tokens=8, temperature=1.5, seed=3, allowed_token_ids=[7, 9],
                      return_token_ids=True)["choices"][0]["token_ids"]
    assert set(kept) <= {7, 9}
    idle(srv)


def test_logprobs_over_http_are_generates_in_openais_shapes(srv):
    """``logprobs`` (completions) and ``logprobs``/``top_logprobs`` (chat) carry the engine's records in vLLM's
    shapes (``_create_completion_logprobs``, ``_create_chat_logprobs``): the same numbers as offline ``generate``,
    the sampled token's record first, text offsets that add up, a stream's chunks adding up to the whole."""
    llm = LLM(tiny_model(0), tokenizer=tiny_tokenizer(), num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE,
              max_model_len=MAX_MODEL_LEN)
    want = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
                        use_tqdm=False)[0].outputs[0]
    body = completion(srv, prompt=[9, 8, 7], max_tokens=6, temperature=0, logprobs=2, return_token_ids=True)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["token_ids"] == want.token_ids
    sampled = [e[t] for t, e in zip(want.token_ids, want.logprobs, strict=True)]
    assert lp["token_logprobs"] == pytest.approx([s.logprob for s in sampled])
    assert lp["tokens"] == [s.decoded_token for s in sampled]
    assert all(len(top) <= 3 and list(top.values())[0] == tok_lp  # sampled first, then the top 2
               for top, tok_lp in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(6)]
    r = srv.client.post("/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 6, "temperature": 0,
                                                 "logprobs": 2, "stream": True})
    chunks = [c["logprobs"] for e in sse(r.text) for c in e["choices"]]
    assert [t for c in chunks for t in c["tokens"]] == lp["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == lp["text_offset"]
    as_ids = completion(srv, prompt=[9, 8, 7], max_tokens=6, temperature=0, logprobs=0,
                        return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert as_ids["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert all(len(top) == 1 for top in as_ids["top_logprobs"])
    chat = srv.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
        "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    assert len(chat) == 4 and all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"]
                                  and c["bytes"] == list(c["token"].encode()) for c in chat)
    for extra in ({}, {"logprobs": True, "top_logprobs": None}):  # vLLM: no logprobs without top_logprobs
        for stream in (False, True):
            r = srv.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
                "stream": stream, **extra})
            assert r.status_code == 200, r.text
            choices = [c for e in sse(r.text) for c in e["choices"]] if stream else r.json()["choices"]
            assert all(c["logprobs"] is None for c in choices) and "error" not in r.text, (extra, r.text)
    idle(srv)


def test_echo_with_logprobs_gives_the_prompts_logprobs_first(srv):
    """``echo`` with ``logprobs`` asks the engine for the prompt's logprobs too (vLLM's ``to_sampling_params``:
    ``prompt_logprobs = logprobs``): the choice's logprobs cover the prompt, its first token ``null`` (nothing comes
    before it), then the output; the numbers are offline ``generate``'s ``prompt_logprobs``; ``max_tokens`` 0 gives
    the prompt's alone; a stream's first chunk carries them; the choice's ``prompt_logprobs`` holds the records
    (chat's: the response's, over the rendered prompt)."""
    prompt = [9, 8, 7, 30, 31]
    llm = LLM(tiny_model(0), tokenizer=tiny_tokenizer(), num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE,
              max_model_len=MAX_MODEL_LEN)
    want = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, prompt_logprobs=1),
                        use_tqdm=False)[0]
    ids = prompt + want.outputs[0].token_ids
    records = want.prompt_logprobs + want.outputs[0].logprobs
    body = completion(srv, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([r[t].logprob for t, r in zip(ids[1:], records[1:],
                                                                                      strict=True)])
    assert lp["tokens"] == [tiny_tokenizer().decode([t]) for t in ids[:1]] + [r[t].decoded_token for t, r in
                                                                               zip(ids[1:], records[1:], strict=True)]
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert [list(map(int, r)) if r else r for r in choice["prompt_logprobs"]] == \
        [list(r) if r else r for r in want.prompt_logprobs]
    field = completion(srv, prompt=prompt, max_tokens=3, temperature=0, prompt_logprobs=1)["choices"][0]
    assert field["logprobs"] is None and field["prompt_logprobs"] == choice["prompt_logprobs"]
    chat = srv.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "prompt_logprobs": 0,
                                                         "return_token_ids": True}).json()
    rendered = chat["prompt_token_ids"]  # the chat template's tokens: the prompt the records are of
    assert len(chat["prompt_logprobs"]) == len(rendered) and chat["prompt_logprobs"][0] is None
    assert [list(map(int, r)) for r in chat["prompt_logprobs"][1:]] == [[t] for t in rendered[1:]]
    only = completion(srv, prompt=prompt, max_tokens=0, logprobs=0, echo=True)["choices"][0]["logprobs"]
    assert only["token_logprobs"][0] is None and len(only["tokens"]) == len(prompt)
    assert only["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:len(prompt)])
    r = srv.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                                 "echo": True, "stream": True})
    chunks = [c["logprobs"] for e in sse(r.text) for c in e["choices"]]
    streamed = [t for c in chunks for t in c["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:])
    assert len(chunks[0]["tokens"]) >= len(prompt)  # the prompt's ride on the first chunk
    assert [t for c in chunks for t in c["tokens"]] == lp["tokens"]
    idle(srv)


def test_bad_words_over_http(srv):
    """``bad_words`` reach the engine: the word the greedy completion says is never said, streamed or not."""
    plain = completion(srv, prompt="hello there", max_tokens=8, temperature=0, return_token_ids=True)["choices"][0]
    tok = tiny_tokenizer()
    word = next(t for t in (tok.decode([i]) for i in plain["token_ids"][1:])
                if t.strip() and t.isprintable() and len(tok.encode(t.lstrip(), add_special_tokens=False)) == 1)
    banned = tok.encode(word.lstrip(), add_special_tokens=False)[0]
    for stream in (False, True):
        r = srv.client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 8, "temperature": 0,
                                                     "bad_words": [word], "return_token_ids": True,
                                                     "stream": stream})
        assert r.status_code == 200, r.text
        ids = [t for e in sse(r.text) for c in e["choices"] for t in c["token_ids"] or []] if stream else \
            r.json()["choices"][0]["token_ids"]
        assert banned not in ids and ids != plain["token_ids"]
    idle(srv)


def test_max_logprobs_and_generation_config_flags():
    """vLLM's ``--max-logprobs`` and ``--generation-config`` reach the engine: 25 logprobs refused at the default
    20 and served at 30; with ``vllm`` the model's generation config no longer fills omitted fields."""
    with serving("--max-logprobs", "30", "--generation-config", "vllm") as s:
        assert s.llm.max_logprobs == 30 and s.llm.generation_config == "vllm"
        top = completion(s, prompt=[9, 8, 7], max_tokens=2, temperature=0, logprobs=25,
                         return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
        assert [len(t) for t in top["top_logprobs"]] == [25, 25]  # greedy: the sampled token is the top one
        s.llm.model.generation_config.temperature = 0.0  # ignored: "vllm"
        assert s.llm.get_diff_sampling_param() == {}
    r = make_arg_parser().parse_args(["tiny"])
    assert (r.max_logprobs, r.generation_config) == (20, "auto")


def test_cache_salt_isolates_tenants(srv):
    """The paired test: a prompt of four full blocks is served from the prefix cache for a second request with
    the same salt, and not at all for another salt (or none): the salt enters the first block's hash."""
    prompt = list(range(200, 200 + 4 * BLOCK_SIZE + 3))

    def cached(salt):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        return completion(srv, **body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 4 * BLOCK_SIZE  # reuse within one salt
    assert cached("tenant-b") == 0  # none across salts
    assert cached(None) == 0
    assert cached(None) == 4 * BLOCK_SIZE
    assert cached("tenant-b") == 4 * BLOCK_SIZE
    idle(srv)


MUTATIONS = [("n", 0, "n must be at least 1, got 0"), ("max_tokens", -3, "max_tokens must be"),
             ("temperature", 7.0, "temperature must be"), ("top_k", -5, "top_k must be"),
             ("top_p", 0.0, "top_p must be"), ("seed", 2**70, "seed must be"),
             ("stop_token_ids", [1, -2], "stop_token_ids")]


@pytest.fixture(scope="module")
def small_llm() -> LLM:
    return LLM(tiny_model(0), num_gpu_blocks=40, block_size=8, max_model_len=64)


@pytest.mark.parametrize("field, value, message", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_async_generate_checks_a_field_changed_after_construction(small_llm, field, value, message):
    """``AsyncLLM.generate`` re-checks its ``SamplingParams`` as ``LLM.generate`` does (the same
    ``SamplingParams.verified``): ``sp.n = 0`` used to yield nothing and return; now the call raises
    ``InvalidRequestError`` and leaves the engine, the pool and the loop's queues as they were."""
    from pagedkv.engine.async_llm import AsyncLLM, InvalidRequestError

    llm = small_llm
    engine = AsyncLLM(llm, "tiny")
    prompt = [5, 17, 42, 8, 99, 3]

    def state():
        s = llm.scheduler
        return (s.kv_cache_manager.block_pool.get_num_free_blocks(), len(s.waiting), len(s.running),
                sorted(s.requests), dict(engine._states), dict(engine._queues), list(engine._pending))

    async def tokens(sp):
        return [t for d in [d async for d in engine.generate(prompt, sp)] for t in d.token_ids]

    async def main():
        await engine.start()
        try:
            before = state()
            expected = await tokens(SamplingParams(max_tokens=4, temperature=0.0))
            assert state() == before
            sp = SamplingParams(max_tokens=4, temperature=0.0)
            setattr(sp, field, value)
            with pytest.raises(InvalidRequestError, match=message):
                await tokens(sp)
            assert state() == before
            assert getattr(sp, field) == value  # the caller's object is not touched
            assert await tokens(SamplingParams(max_tokens=4, temperature=0.0)) == expected
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_contiguous_reservation_same_tokens_fewer_running():
    """--kv-reservation contiguous: the same greedy tokens, each request holding ceil(max_model_len / block_size)
    blocks from admission, so at most (BLOCKS - 1) // 16 = 3 run at once."""
    with serving("--kv-reservation", "contiguous") as s:
        body = completion(s, prompt=PROMPTS, max_tokens=12, temperature=0, return_token_ids=True)
        llm = LLM(tiny_model(0), num_gpu_blocks=BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
        offline = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
        assert [c["token_ids"] for c in body["choices"]] == [o.outputs[0].token_ids for o in offline]

        async def burst():
            async with httpx.AsyncClient(base_url=s.base, timeout=120) as c:
                tasks = [asyncio.create_task(c.post("/v1/completions", json={"prompt": [i + 1] * 8,
                                                                             "max_tokens": 40}))
                         for i in range(8)]
                seen = 0
                for _ in range(400):
                    snap = (await c.get("/pagedkv/snapshot")).json()
                    tables = snap["block_tables"].values()
                    assert all(len(t) == MAX_MODEL_LEN // BLOCK_SIZE for t in tables)
                    seen = max(seen, len(snap["running"]))
                    if all(t.done() for t in tasks):
                        break
                    await asyncio.sleep(0.01)
                return seen, [t.result().status_code for t in tasks]

        seen, codes = asyncio.run(burst())
        assert codes == [200] * 8 and 1 <= seen <= (BLOCKS - 1) // (MAX_MODEL_LEN // BLOCK_SIZE)
        idle(s)


def test_bench_serve_against_the_server(srv, tmp_path):
    from pagedkv.benchmarks.serve import benchmark, sharegpt_like_requests

    reqs = sharegpt_like_requests(8, MAX_MODEL_LEN, 512, seed=3)
    assert all(len(r.prompt_token_ids) + r.output_len <= MAX_MODEL_LEN for r in reqs)
    out = asyncio.run(benchmark(srv.base, "tiny", reqs, float("inf"), poll=0.05))
    assert out["completed"] == 8 and out["failed"] == 0
    assert out["total_output_tokens"] == sum(r.output_len for r in reqs)
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                "num_preemptions", "max_running"):
        assert key in out
    assert out["timeseries"] and out["max_running"] >= 1


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
def test_compare_interleaves_the_modes_and_aggregate_takes_the_median(srv, tmp_path):
    """compare(): repetition, then rate, then mode, each run tagged; aggregate(): one row per (mode, rate) with
    the median and the min-max of the main figures, which format_table and plot show."""
    import matplotlib

    matplotlib.use("Agg")
    from pagedkv.benchmarks.serve import aggregate, compare, format_table, plot, sharegpt_like_requests

    reqs = sharegpt_like_requests(3, MAX_MODEL_LEN, 512, seed=5, scale=0.02)
    bases = {"a": srv.base, "b": srv.base}
    runs = asyncio.run(compare(bases, "tiny", reqs, [float("inf"), 50.0], repeats=2, poll=0.05))
    assert [(r["repeat"], r["request_rate"], r["mode"]) for r in runs] == [
        (i, rate, m) for i in (0, 1) for rate in ("inf", 50.0) for m in ("a", "b")]
    assert all(r["completed"] == 3 and r["failed"] == 0 for r in runs)
    rows = aggregate(runs)
    assert [(r["mode"], r["request_rate"], r["repeats"]) for r in rows] == [
        ("a", "inf", 2), ("b", "inf", 2), ("a", 50.0, 2), ("b", 50.0, 2)]
    for row in rows:
        key = (row["mode"], row["request_rate"])
        values = [r["median_ttft_ms"] for r in runs if (r["mode"], r["request_rate"]) == key]
        assert row["median_ttft_ms"] == pytest.approx(sum(values) / 2)  # the median of two
        assert row["median_ttft_ms_min"] == min(values) and row["median_ttft_ms_max"] == max(values)
        assert row["total_output_tokens"] == sum(r.output_len for r in reqs)
    table = format_table(rows)
    assert "req/s range" in table.splitlines()[0] and "TTFT med range" in table.splitlines()[0]
    plot(rows, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0
    idle(srv)


def test_bench_serve_repeats_flag():
    from pagedkv.benchmarks.serve import build_parser

    assert build_parser().parse_args(["--launch", "tiny", "--repeats", "3"]).repeats == 3
    assert build_parser().parse_args(["--launch", "tiny"]).repeats == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--launch", "tiny", "--repeats", "0"])


@pytest.mark.slow
def test_pagedkv_serve_command_answers_the_openai_client(tmp_path):
    """``pagedkv serve tiny --port 0`` as a learner starts it: it prints its address, answers, and stops."""
    openai = pytest.importorskip("openai")
    from pagedkv.benchmarks.serve import launched_server

    with launched_server("tiny", ["--max-model-len", "128", "--num-gpu-blocks", "32"]) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4)
        assert out.usage.completion_tokens == 4


def test_the_gpu_serve_step_is_planned_and_its_flags_parse(tmp_path):
    """kernels/device_check.py --with-serve: the prepared GPU run (it cannot run here). Its server flags parse
    as `pagedkv serve`'s, and its model override is a JSON object."""
    import shlex

    from pagedkv.kernels import device_check as dc

    from pagedkv.benchmarks.serve import build_parser

    assert "serve-bench" not in dict(dc.plan(dc.parse_args([]), tmp_path))
    cmd = dict(dc.plan(dc.parse_args(["--with-serve"]), tmp_path))["serve-bench"]
    bench = build_parser().parse_args(cmd[3:])
    assert bench.launch == "tiny" and bench.modes == ["paged", "contiguous"]
    server = make_arg_parser().parse_args(["tiny", *shlex.split(bench.server_args)])
    assert json.loads(server.hf_overrides)["num_hidden_layers"] == 16
    assert server.kv_cache_memory_bytes == dc.SERVE_KV_BYTES and server.max_model_len == 2048


def test_start_up_text_is_true_on_a_cpu_and_names_only_real_flags(capsys):
    """On a CPU the server says how its pool was sized without GPU wording (no "GPU KV cache size", no "# GPU
    blocks") and names only flags `pagedkv serve` has (it used to suggest a `total_memory` that no flag sets)."""
    import re

    parser = make_arg_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for argv, says in ((["--gpu-memory-utilization", "0.05"], "a CPU has no device memory to profile"),
                       (["--num-gpu-blocks", "48"], "48 blocks of 16 tokens"),
                       (["--kv-cache-memory-bytes", str(2**20)], "--kv-cache-memory-bytes 1,048,576")):
        engine, _ = build_engine(parser.parse_args(["tiny", "--max-model-len", "128", *argv]))
        out = capsys.readouterr().out
        assert says in out and f"{engine.llm.num_gpu_blocks:,} blocks of 16 tokens (" in out, out
        for wrong in ("GPU KV cache", "GPU blocks", "CUDA graph", "total_memory", "Memory profiling"):
            assert wrong not in out, (wrong, out)
        assert set(re.findall(r"--[a-z][a-z-]+", out)) <= flags, out
    assert "Choose its size with --num-gpu-blocks N or --kv-cache-memory-bytes BYTES." in \
        describe_kv_pool(engine.llm, parser.parse_args(["tiny"]), "")


def test_start_up_text_on_a_gpu_is_the_measured_profile():
    """On a CUDA GPU a profiled pool is described by the profile's own lines (vLLM's start-up log, measured);
    a pool set by a flag by one line naming the flag and the device."""
    import torch

    gpu = SimpleNamespace(device=torch.device("cuda", 0), num_gpu_blocks=1000, block_size=16, max_model_len=2048,
                          memory_profile=object(), runner=SimpleNamespace(kv_cache_bytes=lambda: 1000 * 2**16))
    log = "Memory profiling (measured): total memory 139.8 GiB ...\n# GPU blocks: 1000, concurrency ...\n"
    parser = make_arg_parser()
    assert describe_kv_pool(gpu, parser.parse_args(["tiny"]), log) == log.rstrip()
    line = describe_kv_pool(gpu, parser.parse_args(["tiny", "--num-gpu-blocks", "1000"]), "")
    assert line.startswith("KV pool: 1,000 blocks of 16 tokens (62.5 MiB on cuda:0), as --num-gpu-blocks sets")


def test_hf_overrides_and_kv_cache_memory_bytes_size_the_engine():
    args = make_arg_parser().parse_args(["tiny", "--hf-overrides", '{"num_hidden_layers": 1}', "--max-model-len",
                                         "64", "--kv-cache-memory-bytes", str(2**20)])
    engine, _ = build_engine(args)
    cfg = engine.llm.model.config
    assert cfg.num_hidden_layers == 1
    block_bytes = 2 * BLOCK_SIZE * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert engine.llm.num_gpu_blocks == 2**20 // block_bytes
    for bad in ('[1]', '{"num_hidden_layers": 1'):
        with pytest.raises(ValueError):
            build_engine(make_arg_parser().parse_args(["tiny", "--hf-overrides", bad]))


def test_a_missing_local_model_folder_and_bad_overrides_are_named():
    """``pagedkv serve ./nowhere`` said what Hugging Face says of a malformed repo id; ``--hf-overrides '{bad'``
    printed the JSON parser's text without naming the flag."""
    for path in ("/nonexistent/model", "./no-such-model", "../no-such-model"):
        with pytest.raises(ValueError, match="no such folder"):
            LLM(path)
        with pytest.raises(ValueError, match="no such folder"):
            build_engine(make_arg_parser().parse_args([path]))
    with pytest.raises(ValueError, match=r"^--hf-overrides is not valid JSON \("):
        build_engine(make_arg_parser().parse_args(["tiny", "--hf-overrides", "{bad"]))


def test_scheduling_policy_flag_reaches_the_scheduler_as_vllms():
    """``--scheduling-policy priority`` (vLLM's flag; the lab's server had none, so a request's ``priority``
    field was always ignored): the engine's scheduler orders its waiting queue by priority, also after
    ``--kv-reservation contiguous`` swaps the scheduler."""
    from pagedkv.request_queue import SchedulingPolicy

    for extra in ([], ["--kv-reservation", "contiguous"]):
        args = make_arg_parser().parse_args(["tiny", "--max-model-len", "64", "--num-gpu-blocks", "40",
                                             "--scheduling-policy", "priority", *extra])
        engine, _ = build_engine(args)
        assert engine.llm.scheduler.policy is SchedulingPolicy.PRIORITY
    assert make_arg_parser().parse_args(["tiny"]).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["tiny", "--scheduling-policy", "lifo"])
