"""The stub engine's server: its shared state (counters, pending answers, injected faults) and
`StubServer`, which dispatches the requests of its connections to SGLang's endpoints and the
`/_stub/...` test controls."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from mrlx_lab.stub_engine.answers import (
    DONE,
    FAULT_MODES,
    STREAM_ERROR,
    STREAM_FAULTS,
    StubConfig,
    answer,
    sse,
    stream_chunk,
    streamed_tokens,
    text_index,
)
from mrlx_lab.stub_engine.connection import Connection, error, json_response, response, stream_head
from mrlx_plugin.core.values import JSON, JSONObject


@dataclass
class _Stream:
    """A streamed answer: the whole answer, built on arrival, and how much of it went out."""

    whole: JSONObject
    fault: str | None  # a STREAM_FAULTS mode: what happens after the first chunk
    started: bool = False  # the head went out
    sent: int = 0  # tokens sent


@dataclass
class _Pending:
    """A /generate answer not sent yet (waiting for its latency, or held by a pause), or a streamed
    one not sent in full (its chunks `--stream-delay` apart)."""

    conn: Connection
    rids: list[str]
    build: Callable[[str | None], JSON]  # abort message (None = normal answer) -> the answer(s)
    close: bool = False  # close the connection after answering
    timer: asyncio.TimerHandle | None = None
    due: bool = False  # latency elapsed; held only because generation is paused
    # The normal answer, built on arrival: a burst of answers falling due together is then sent
    # at once, as an engine that generated them during the latency would, not one build apart.
    ready: bytes | None = None
    stream: _Stream | None = None


@dataclass
class StubState:
    config: StubConfig
    stats: dict[str, int] = field(
        default_factory=lambda: {
            "requests": 0,
            "generate": 0,
            "generate_ok": 0,
            "aborted": 0,
            "faults_served": 0,
            "connections": 0,
            "weight_updates": 0,
            "streams": 0,  # streamed answers begun
            "cancelled": 0,  # answers whose client went away before they were sent in full
        }
    )
    fault_mode: str = "none"
    fault_count: int = 0
    last_generate: JSONObject | None = None
    paused: str | None = None
    last_update_path: str | None = None
    lora_paths: dict[str, int] = field(default_factory=dict)  # requests per lora_path ("" the base)
    pending: dict[int, _Pending] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def take_fault(self) -> str | None:
        if self.fault_count > 0 and self.fault_mode != "none":
            self.fault_count -= 1
            self.stats["faults_served"] += 1
            return self.fault_mode
        return None


class StubServer:
    """Dispatches requests of `Connection`s; holds the shared state."""

    def __init__(self, config: StubConfig):
        self.state = StubState(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0
        self.routes: dict[tuple[str, str], Callable[[bytes], bytes]] = {
            ("GET", "/health"): lambda b: response(200, b""),
            ("GET", "/health_generate"): lambda b: response(200, b""),
            ("GET", "/get_model_info"): self.model_info,
            ("GET", "/model_info"): self.model_info,
            ("GET", "/get_server_info"): self.server_info,
            ("GET", "/server_info"): self.server_info,
            ("GET", "/get_weight_version"): lambda b: json_response(
                {"weight_version": self.state.config.weight_version}
            ),
            ("GET", "/flush_cache"): self.flush_cache,
            ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/v1/loads"): self.loads,
            ("GET", "/get_load"): self.get_load,
            ("POST", "/abort_request"): self.abort_request,
            ("POST", "/pause_generation"): self.pause_generation,
            ("POST", "/continue_generation"): self.continue_generation,
            ("POST", "/update_weights_from_disk"): self.update_weights,
            ("POST", "/_stub/faults"): self.set_faults,
            ("GET", "/_stub/stats"): self.get_stats,
            ("GET", "/_stub/last"): lambda b: json_response(self.state.last_generate),
            ("POST", "/_stub/last"): lambda b: json_response(self.state.last_generate),
            ("POST", "/_stub/reset"): self.reset,
        }

    def protocol(self) -> Connection:
        return Connection(self)

    # --- dispatch --------------------------------------------------------------------------

    def handle(self, conn: Connection, method: str, path: str, body: bytes, close: bool) -> None:
        self.state.stats["requests"] += 1
        if path == "/generate":
            if method != "POST":
                conn.send(error("use POST /generate", 405), close)
                return
            self.generate(conn, body, close)
            return
        route = self.routes.get((method, path))
        if route is None:
            known = any(p == path for _, p in self.routes)
            conn.send(error(f"{method} {path} is not served here", 405 if known else 404), close)
            return
        try:
            conn.send(route(body), close)
        except _BadRequest as exc:
            conn.send(error(str(exc), 400), close)

    # --- /generate -------------------------------------------------------------------------

    def generate(self, conn: Connection, body: bytes, close: bool) -> None:
        st = self.state
        st.stats["generate"] += 1
        admitted = self._admit(conn, body, close)
        if admitted is None:
            return
        req, fault = admitted
        rids, build = self._answers(req, body, fault)
        stream = req.get("stream") is True
        if not stream and fault == "abort":
            st.stats["aborted"] += 1
            conn.send(response(200, orjson.dumps(build("injected fault: aborted"))), close)
            return
        if not stream and fault == "stream_error":  # what SGLang answers unstreamed for the same failure
            conn.send(error(STREAM_ERROR, 400), close)
            return
        if not stream and fault == "cut":
            raw = response(200, orjson.dumps(build(None)))
            conn.send(raw[: len(raw) - len(raw) // 4], close=True)
            return
        if not stream and st.config.latency <= 0 and st.paused is None:
            st.stats["generate_ok"] += 1
            conn.send(response(200, orjson.dumps(build(None))), close)
            return
        # Answer later, or stream: the connection waits (answers stay in order).
        conn.busy = True
        self._next_id += 1
        key = self._next_id
        pending = _Pending(conn, rids, build, close)
        if stream:
            whole = build("injected fault: aborted" if fault == "abort" else None)
            assert isinstance(whole, dict)  # a batched request does not stream (`_admit`)
            pending.stream = _Stream(whole, fault if fault in STREAM_FAULTS else None)
            st.stats["streams"] += 1
        else:
            pending.ready = orjson.dumps(build(None))
        st.pending[key] = pending
        assert self.loop is not None
        if st.config.latency > 0:
            pending.timer = self.loop.call_later(st.config.latency, self._due, key)
        elif st.paused is None:  # a stream, at once (after this request's handling returns)
            self.loop.call_soon(self._finish, key, None)
        else:
            pending.due = True  # only the pause holds it

    def _admit(self, conn: Connection, body: bytes, close: bool) -> tuple[JSONObject, str | None] | None:
        """The request and the fault it draws (if any); None once it is answered: refused (not a
        JSON object, an adapter not served), or failed at once by its fault."""
        st = self.state
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            conn.send(error(f"body is not valid JSON ({exc})", 400), close)
            return None
        if not isinstance(req, dict):
            conn.send(error("body must be a JSON object", 400), close)
            return None
        st.last_generate = req
        ids, text = req.get("input_ids"), req.get("text")
        if req.get("stream") is True and (
            isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
        ):
            conn.send(error("stream: true takes one prompt here; send a batch without stream", 400), close)
            return None
        loras = req.get("lora_path")
        for lora in loras if isinstance(loras, list) else [loras]:
            if lora is not None and lora not in st.config.lora_names:
                served = ", ".join(st.config.lora_names) or "none"
                conn.send(error(f"LoRA adapter {lora!r} is not loaded (served: {served})", 400), close)
                return None
            st.lora_paths[lora or ""] = st.lora_paths.get(lora or "", 0) + 1
        fault = st.take_fault()
        if fault == "http500":
            conn.send(error("injected fault: internal server error", 500), close)
        elif fault == "close":
            conn.send(b"", close=True)
        elif fault == "bad_json":
            conn.send(response(200, b'{"text": "truncated', b"application/json"), close)
        elif fault == "stall":
            conn.busy = True  # nothing more is answered on this connection
        else:
            return req, fault
        return None

    def _answers(
        self, req: JSONObject, body: bytes, fault: str | None
    ) -> tuple[list[str], Callable[[str | None], JSON]]:
        """The request ids of `req` (one per prompt) and the builder of its answer: one answer per
        prompt (a list when the request is batched), given an abort message or None."""
        st = self.state
        ids = req.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            batched, prompts = True, ids
        elif ids is None and isinstance(req.get("text"), list):
            batched, prompts = True, req["text"]
        else:
            batched, prompts = False, [ids if ids is not None else req.get("text")]
        count = len(prompts)
        params = req.get("sampling_params") or {}
        if isinstance(params, list):
            params = params[0] if params else {}
        if not isinstance(params, dict):
            params = {}
        max_new = params.get("max_new_tokens")
        # SGLang's text keeps the matched stop token's string only with both of these (slime's).
        eos_in_text = params.get("skip_special_tokens") is False and params.get("no_stop_trim") is True
        return_logprob = bool(req.get("return_logprob"))
        rid = req.get("rid")
        rids = (
            rid
            if isinstance(rid, list)
            else [rid if isinstance(rid, str) else f"stub-{st.stats['generate']}"] * count
        )
        if req.get("stream") is True:  # the log-probs of the same request unstreamed
            body = orjson.dumps({k: v for k, v in req.items() if k != "stream"})
        seed = zlib.crc32(body)
        cfg = st.config
        # "{i}" in --text becomes the request's number, so that answers differ like real ones.
        number = st.stats["generate"]
        pick = text_index(cfg, number, req) if len(cfg.texts) > 1 else None
        text = cfg.texts[pick] if pick is not None else cfg.text
        text = text.replace("{i}", str(number)) if "{i}" in text else text
        # Prompt length: exact for ids; for text there is no tokenizer here, so ~4 chars a token.
        sizes = [
            len(p) if isinstance(p, list) else len(p) // 4 + 1 if isinstance(p, str) else 0 for p in prompts
        ]

        def build(abort_message: str | None) -> JSON:
            answers: list[JSON] = []
            for i in range(count):
                one = answer(
                    cfg,
                    seed + i,
                    rids[i] if i < len(rids) else None,
                    None if fault == "too_many_tokens" else max_new,
                    return_logprob,
                    abort_message,
                    sizes[i],
                    text,
                    eos_in_text,
                    fault,
                    number,
                    pick,
                )
                answers.append(one)
            return answers if batched else answers[0]

        return rids, build

    def _due(self, key: int) -> None:
        pending = self.state.pending.get(key)
        if pending is None:
            return
        pending.timer = None
        pending.due = True
        if self.state.paused is None:
            self._finish(key, None)

    def _finish(self, key: int, abort_message: str | None) -> None:
        """Send the answer that is due (a stream: go on streaming), or an abort."""
        pending = self.state.pending.get(key)
        if pending is None:
            return
        if pending.stream is not None and abort_message is None:
            self._stream_on(key, pending, pending.stream)
            return
        del self.state.pending[key]
        if pending.timer is not None:
            pending.timer.cancel()
        self.state.stats["aborted" if abort_message else "generate_ok"] += 1
        if pending.stream is not None:  # the abort is the stream's last chunk
            s = pending.stream
            finish: JSONObject = {"type": "abort", "message": abort_message}
            chunk = stream_chunk(s.whole, s.sent, s.sent, self.state.config.incremental, finish)
            head = b"" if s.started else stream_head(pending.close)
            pending.conn.send(head + _piece(sse(chunk) + DONE) + _LAST_PIECE, pending.close)
        else:
            body = (
                pending.ready
                if abort_message is None and pending.ready is not None
                else orjson.dumps(pending.build(abort_message))
            )
            pending.conn.send(response(200, body), pending.close)
        pending.conn.resume()

    def _stream_on(self, key: int, pending: _Pending, s: _Stream) -> None:
        """Send a streamed answer's next chunks: all of them, or one every `--stream-delay` seconds
        (a timer calls this again); its last one, then `[DONE]`, ends it."""
        cfg, conn, meta = self.state.config, pending.conn, s.whole["meta_info"]
        assert isinstance(meta, dict)
        pending.timer, pending.due = None, False  # under way: a pause does not hold it
        out = b"" if s.started else stream_head(pending.close)
        s.started = True
        total = streamed_tokens(s.whole)
        while True:
            end = min(s.sent + max(1, cfg.stream_tokens), total)
            finish = meta["finish_reason"] if end >= total else None
            out += _piece(sse(stream_chunk(s.whole, s.sent, end, cfg.incremental, finish)))
            first, s.sent = s.sent == 0, end
            if first and s.fault == "cut":  # the connection drops mid-stream
                del self.state.pending[key]
                conn.send(out, close=True)
                return
            if first and s.fault == "stream_error":  # SGLang's error event ends the stream
                del self.state.pending[key]
                out += _piece(sse({"error": {"message": STREAM_ERROR}}) + DONE) + _LAST_PIECE
                conn.send(out, pending.close)
                conn.resume()
                return
            if finish is not None:
                del self.state.pending[key]
                aborted = isinstance(finish, dict) and finish.get("type") == "abort"
                self.state.stats["aborted" if aborted else "generate_ok"] += 1
                conn.send(out + _piece(DONE) + _LAST_PIECE, pending.close)
                conn.resume()
                return
            if cfg.stream_delay > 0:
                conn.send(out)
                assert self.loop is not None
                pending.timer = self.loop.call_later(cfg.stream_delay, self._stream_on, key, pending, s)
                return

    def forget(self, conn: Connection) -> None:
        for key in [k for k, p in self.state.pending.items() if p.conn is conn]:
            p = self.state.pending.pop(key)
            self.state.stats["cancelled"] += 1
            if p.timer is not None:
                p.timer.cancel()

    # --- control ---------------------------------------------------------------------------

    def model_info(self, body: bytes) -> bytes:
        c = self.state.config
        return json_response(
            {
                "model_path": c.model_path,
                "tokenizer_path": None,
                "is_generation": True,
                "weight_version": c.weight_version,
            }
        )

    def server_info(self, body: bytes) -> bytes:
        c = self.state.config
        return json_response(
            {
                "engine": "mrlx-stub",
                "weight_version": c.weight_version,
                "latency": c.latency,
                "response_tokens": c.response_tokens,
                "vocab_size": c.vocab_size,
                "tp_size": 1,
                "dp_size": 1,
                "paused": self.state.paused,
                "uptime_s": time.time() - self.state.started,
            }
        )

    def flush_cache(self, body: bytes) -> bytes:
        return json_response({"success": True, "message": "Cache flushed."})

    def loads(self, body: bytes) -> bytes:
        n = len(self.state.pending)
        return json_response(
            {"loads": [{"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0, "num_total_reqs": n}]}
        )

    def get_load(self, body: bytes) -> bytes:
        return json_response([{"dp_rank": 0, "num_reqs": len(self.state.pending), "num_waiting_reqs": 0}])

    def abort_request(self, body: bytes) -> bytes:
        req = _parse_object(body)
        abort_all = req.get("abort_all") is True
        rid = req.get("rid")
        if not abort_all and not (isinstance(rid, str) and rid):
            raise _BadRequest('send {"abort_all": true} or {"rid": "<request id>"}')
        keys = [k for k, p in self.state.pending.items() if abort_all or rid in p.rids]
        for k in keys:
            self._finish(k, "aborted by /abort_request")
        return json_response({"success": True, "num_aborted": len(keys)})

    def pause_generation(self, body: bytes) -> bytes:
        req = _parse_object(body)
        mode = req.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise _BadRequest(f'mode must be "abort", "in_place" or "retract", got {mode!r}')
        self.state.paused = mode
        n = 0
        if mode == "abort":
            keys = list(self.state.pending)
            n = len(keys)
            for k in keys:
                self._finish(k, "aborted by /pause_generation")
        return json_response({"success": True, "message": f"generation paused ({mode})", "num_aborted": n})

    def continue_generation(self, body: bytes) -> bytes:
        self.state.paused = None
        for k in [k for k, p in self.state.pending.items() if p.due]:  # (a stream under way is never held)
            self._finish(k, None)
        return json_response({"success": True, "message": "generation continued"})

    def update_weights(self, body: bytes) -> bytes:
        req = _parse_object(body)
        path = req.get("model_path")
        if not isinstance(path, str) or not path:
            return json_response(
                {
                    "success": False,
                    "message": "model_path must be a non-empty string",
                    "num_paused_requests": 0,
                },
                400,
            )
        c = self.state.config
        version = req.get("weight_version")
        if version is not None:
            c.weight_version = str(version)
        elif c.weight_version.isdigit():
            c.weight_version = str(int(c.weight_version) + 1)
        if req.get("abort_all_requests") is True:
            for k in list(self.state.pending):
                self._finish(k, "aborted by /update_weights_from_disk (abort_all_requests)")
        # model_path stays as reported: the stub loads nothing, and a router that probes it
        # later must not be sent looking for a path that is not there.
        self.state.last_update_path = path
        self.state.stats["weight_updates"] += 1
        return json_response(
            {"success": True, "message": f"weight_version {c.weight_version}", "num_paused_requests": 0}
        )

    def set_faults(self, body: bytes) -> bytes:
        req = _parse_object(body)
        mode = req.get("mode")
        count = req.get("count", 1)
        if mode not in FAULT_MODES:
            raise _BadRequest(f"mode must be one of {', '.join(FAULT_MODES)}, got {mode!r}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise _BadRequest(f"count must be an integer >= 0, got {count!r}")
        self.state.fault_mode = mode
        self.state.fault_count = 0 if mode == "none" else count
        return json_response({"success": True, "mode": mode, "count": self.state.fault_count})

    def get_stats(self, body: bytes) -> bytes:
        st = self.state
        return json_response(
            {
                **st.stats,
                "pending": len(st.pending),
                "fault_mode": st.fault_mode,
                "faults_left": st.fault_count,
                "weight_version": st.config.weight_version,
                "paused": st.paused,
                "last_update_path": st.last_update_path,
                "lora_paths": st.lora_paths,
            }
        )

    def reset(self, body: bytes) -> bytes:
        for k in self.state.stats:
            self.state.stats[k] = 0
        self.state.fault_mode, self.state.fault_count = "none", 0
        self.state.last_generate = None
        self.state.lora_paths.clear()
        return json_response({"success": True})


class _BadRequest(ValueError):
    pass


_LAST_PIECE = b"0\r\n\r\n"  # the end of a chunked body


def _piece(data: bytes) -> bytes:
    """`data` as one piece of a chunked HTTP body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _parse_object(body: bytes) -> JSONObject:
    if not body.strip():
        return {}
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _BadRequest(f"body is not valid JSON ({exc})") from None
    if not isinstance(req, dict):
        raise _BadRequest("body must be a JSON object")
    return req
