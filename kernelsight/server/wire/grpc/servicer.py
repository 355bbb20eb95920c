"""``VllmEngineServicer``: every RPC of smg-grpc-proto's ``vllm.grpc.engine.VllmEngine`` over one server's
``ServerState`` (the same engine bridges, metrics, faults and KV-event publishers its HTTP app serves with).

RPC → engine:

* Generate → ``generate.GenerateCall``: ``EngineBridge.submit`` as the HTTP completion path submits;
* Embed → a pooling model's prefill (one output token), the vector from ``server/model/embeddings.py``;
* HealthCheck → the bridges' loops running (and the ``unready`` fault), as /health;
* Abort → ``EngineBridge.abort`` of the named requests (their streams end with "abort");
* GetModelInfo / GetServerInfo → the engine config, options and tokenizer;
* GetLoads → each engine's running / waiting counts and KV usage (what /metrics' gauges read);
* GetTokenizer → the served tokenizer saved as HF files, zipped, in 64 KiB chunks (sha256 on the last);
* FlushCache → ``kv.reset_prefix_cache`` on every engine (with the AllBlocksCleared event), retried until the
  request's ``timeout_s``;
* StartProfile / StopProfile → ``success=false``: the simulated GPU has no profiler to run;
* SubscribeKvEvents → ``kv_events.KvEventStream`` over DP rank 0's publisher.

Errors follow vLLM's servicer: ``errors.grpc_code`` of the error the HTTP server would answer, with its message."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import math
import tempfile
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from kernelsight.server.integrations.sleep_mode import SLEEPING_MESSAGE
from kernelsight.server.model.embeddings import embed
from kernelsight.server.state import ServerState
from kernelsight.server.wire.errors import APIError
from kernelsight.server.wire.grpc.errors import RpcFailure
from kernelsight.server.wire.grpc.generate import SHUTTING_DOWN_MESSAGE, GenerateCall, Inflight
from kernelsight.server.wire.grpc.kv_events import KvEventStream
from kernelsight.server.wire.protocol.version import VLLM_VERSION

log = logging.getLogger("kernelsight.server")

#: GetTokenizer's chunk size (the gateway's limit, as vLLM's servicer sends)
TOKENIZER_CHUNK_BYTES = 64 * 1024
#: FlushCache: the retry interval while requests still hold blocks
FLUSH_RETRY_S = 0.1
SERVER_TYPE = "vllm-grpc"
#: the simulator's activation formats as torch names (GetServerInfo.model_dtype: "torch.bfloat16", as vLLM's)
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KV_EVENTS_OFF = ("KV cache events not enabled. Start vLLM with --kv-events-config "
                 "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'")
NO_TOKENIZER = "Tokenizer path is not configured on this server."
NO_PROFILER = ("Profiling is not available: the GPU is simulated (kernelsight), there is no profiler to run; "
               "the simulator's step timings are in /metrics and --record-timings")


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, state: ServerState, start_unix_s: float | None = None,
                 notify_address: tuple[str, int] | None = None) -> None:
        self.state = state
        self.start_unix_s = time.time() if start_unix_s is None else start_unix_s
        self.inflight = Inflight()
        # where a decode instance announces a finished KV pull (P/D): this replica's HTTP app
        self.notify_address = notify_address
        self._tokenizer_zip: tuple[bytes, str] | None = None

    # -- generation ---------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        call = GenerateCall(self.state, self.inflight, request, context, self.notify_address)
        try:
            async for msg in call.run():
                yield msg
        except APIError as err:
            await context.abort(*_status(RpcFailure.of(err)))
        except RpcFailure as f:
            await context.abort(*_status(f))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            log.exception("Error in Generate for request %s", call.rid)
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        state = self.state
        try:
            if not request.HasField("tokenized"):
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "EmbedRequest requires tokenized input")
            if not state.opts.pooling:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"The model {state.model_name} does not support embeddings: serve an embedding "
                                 f"model (--runner pooling or --convert embed)")
            ids = list(request.tokenized.input_ids)
            L = state.max_model_len
            if not ids:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "The decoder prompt cannot be empty")
            if len(ids) > L:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                                 f"of {L}.")
            bridge = state.bridges[0] if len(state.bridges) == 1 else \
                min(state.bridges, key=lambda b: 4 * b.engine.num_waiting + b.engine.num_running)
            if bridge.closing:
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)
            if state.sleep.is_sleeping:
                raise RpcFailure(grpc.StatusCode.UNAVAILABLE, SLEEPING_MESSAGE)
            state.check_admission(1)
            # a prompt of exactly max_model_len is priced one token shorter (the pooling route's rule)
            sub = bridge.submit([ids[: L - 1] if len(ids) >= L else ids], [1], 1, ignore_eos=True,
                                label=request.request_id or uuid.uuid4().hex, arrival_wall_s=time.perf_counter())
            done = False
            try:
                while not sub.done:
                    await sub.event.wait()
                    sub.event.clear()
                done = True
            finally:
                if done:
                    bridge.release(sub)
                else:
                    bridge.abort(sub)
            vec = embed(ids, state.config.model.hidden_size, state.config.args.seed)
            return pb.EmbedResponse(embedding=vec.tolist(), prompt_tokens=len(ids), embedding_dim=len(vec))
        except APIError as err:
            await context.abort(*_status(RpcFailure.of(err)))
        except RpcFailure as f:
            await context.abort(*_status(f))
        raise AssertionError("unreachable")   # context.abort raises

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        n = self.inflight.abort(list(request.request_ids))
        log.debug("Abort %s: %d submission(s) aborted", list(request.request_ids), n)
        return pb.AbortResponse()

    # -- health and information ---------------------------------------------------------------------
    async def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
                          ) -> pb.HealthCheckResponse:
        state = self.state
        if state.faults.config.unready:      # injected: answered as for a dead engine, as /health answers 503
            state.metrics.on_fault("unready")
            healthy = False
        else:
            healthy = all(b.is_running and not b.closing for b in state.bridges)
        return pb.HealthCheckResponse(healthy=healthy, message="Health" if healthy else "Engine is not alive")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> pb.GetModelInfoResponse:
        state = self.state
        m = state.config.model
        hf = state.tok.hf
        pad = getattr(hf, "pad_token_id", None) if hf is not None else None
        return pb.GetModelInfoResponse(
            model_path=state.opts.model_root, is_generation=not state.opts.pooling,
            max_context_length=state.max_model_len, vocab_size=m.vocab_size, supports_vision=False,
            served_model_name=state.model_name, tokenizer_path=_tokenizer_path(state), model_type=m.model_type,
            architectures=[m.architecture], eos_token_ids=list(m.eos_token_ids), pad_token_id=pad or 0,
            bos_token_id=m.bos_token_id or 0, max_req_input_len=state.max_model_len)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
                            ) -> pb.GetServerInfoResponse:
        state = self.state
        cfg = state.config
        kv = state.opts.kv_transfer
        now = time.time()
        act = cfg.precision.act_dtype
        return pb.GetServerInfoResponse(
            active_requests=sum(b.num_unfinished for b in state.bridges), is_paused=state.sleep.is_sleeping,
            last_receive_timestamp=self.inflight.last_receive_unix_s or now, uptime_seconds=now - self.start_unix_s,
            server_type=SERVER_TYPE,
            kv_connector=(kv.kv_connector or "") if kv is not None else "",
            kv_role=(kv.kv_role or "") if kv is not None else "",
            kv_engine_id=(kv.engine_id or "") if kv is not None and kv.is_kv_transfer_instance else "",
            data_parallel_size=state.opts.data_parallel_size, kv_cache_dtype=cfg.args.kv_cache_dtype,
            block_size=cfg.scheduler.block_size, model_dtype=f"torch.{_TORCH_DTYPES.get(act, act)}",
            max_num_seqs=cfg.scheduler.max_num_seqs)

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetLoadsResponse:
        """One SchedulerLoad per engine rank this server runs (vLLM's servicer reports its one rank), read from the
        engines themselves: current, not a stats snapshot."""
        state = self.state
        s = state.config.scheduler
        loads = []
        for i, b in enumerate(state.bridges):
            if request.HasField("dp_rank") and request.dp_rank != i:
                continue
            e = b.engine
            kv = e.kv
            queries = kv.prefix_queries_tokens
            loads.append(pb.SchedulerLoad(
                dp_rank=i, num_running_reqs=e.num_running, num_waiting_reqs=e.num_waiting,
                num_total_reqs=e.num_running + e.num_waiting, token_usage=max(0.0, kv.usage),
                max_total_num_tokens=state.config.num_gpu_blocks * s.block_size, max_running_requests=s.max_num_seqs,
                cache_hit_rate=kv.prefix_hits_tokens / queries if queries else 0.0,
                num_waiting_uncached_tokens=b.num_prefill_tokens()))
        return pb.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version=VLLM_VERSION,
                                   dp_rank_count=len(loads), loads=loads)

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        tok = self.state.tok
        if tok.hf is None:          # the byte fallback has no files a client could load
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_TOKENIZER)
        if self._tokenizer_zip is None:
            try:
                self._tokenizer_zip = await asyncio.to_thread(tokenizer_bundle, self.state)
            except Exception as exc:  # noqa: BLE001 - reported to the client, the server goes on
                log.exception("Failed to build the tokenizer bundle")
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        assert self._tokenizer_zip is not None
        data, sha = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = min(start + TOKENIZER_CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha if end == len(data) else "")

    # -- administration -----------------------------------------------------------------------------
    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
                         ) -> common_pb2.FlushCacheResponse:
        """vLLM's semantics: the local prefix cache only, no request preempted; refused while requests hold
        blocks, retried until ``timeout_s`` (0: one attempt)."""
        timeout_s = request.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("timeout_s must be finite and non-negative")
            return common_pb2.FlushCacheResponse(success=False, message="Invalid timeout_s")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self._reset_prefix_caches():
                return common_pb2.FlushCacheResponse(success=True,
                                                     message="Local KV prefix cache flushed successfully")
            if timeout_s == 0:
                return common_pb2.FlushCacheResponse(success=False, message="KV prefix cache reset refused; "
                                                                            "requests may be in flight")
            left = deadline - loop.time()
            if left <= 0:
                message = "Flush cache timed out; the engine may still complete an issued reset"
                context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                context.set_details(message)
                return common_pb2.FlushCacheResponse(success=False, message=message)
            await asyncio.sleep(min(FLUSH_RETRY_S, left))

    def _reset_prefix_caches(self) -> bool:
        ok = True
        for b in self.state.bridges:
            ok = b.engine.kv.reset_prefix_cache() and ok
            b.publish_kv_events(b.virtual_now())
        return ok

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
                           ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message=NO_PROFILER)

    async def StopProfile(self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
                          ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message=NO_PROFILER)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        pubs = self.state.kv_publishers
        if not pubs:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, KV_EVENTS_OFF)
        await context.send_initial_metadata(())     # the subscription is live from here: the client may proceed
        async for batch in KvEventStream(pubs[0]).batches():
            yield batch


def _tokenizer_path(state: ServerState) -> str:
    """vLLM's ``model_config.tokenizer``: a local tokenizer's directory, else the model's id (a bundled
    tokenizer is the model's own; GetTokenizer serves its files either way)."""
    src = state.tok.source
    return src.where if src.kind == "hf" else state.opts.model_root


def _status(f: RpcFailure) -> tuple[grpc.StatusCode, str]:
    return f.code, f.message


def tokenizer_bundle(state: ServerState) -> tuple[bytes, str]:
    """The served tokenizer as the files a client rebuilds it from (HF ``save_pretrained``, the chat template the
    server applies, the model's config.json when known), zipped; and the archive's sha256."""
    from kernelsight import profiles

    tok = state.tok
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="kernelsight-tokenizer-") as tmp:
        d = Path(tmp)
        tok.hf.save_pretrained(str(d))
        if tok.chat_template:
            cfg_path = d / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
            cfg["chat_template"] = tok.chat_template
            cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
            (d / "chat_template.jinja").write_text(tok.chat_template, encoding="utf-8")
        config = profiles.model_config_path(state.opts.model_root)
        files = sorted(p for p in d.iterdir() if p.is_file())
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in files:
                zf.write(p, p.name)
            if config is not None and config.is_file() and not (d / "config.json").exists():
                zf.write(config, "config.json")
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
