"""The tokenizer-pool process: chat template + tokenization on the way in, detokenization and stop strings
on the way out.

Tokenizer ``i`` pulls at ``IpcConfig.tokenizer_address(i)``: :class:`GenerateRequest` and
:class:`AbortRequest` from the frontend, :class:`StepOutputs` from the scheduler (for the requests it tokenized,
since their detokenizer state lives here), :class:`ReleaseRequest`. It pushes :class:`TokenizedRequest` /
:class:`AbortRequest` to the scheduler and :class:`TextDelta` / :class:`RequestFailed` to the frontend.

A fault while handling one request (a template that fails to render, a token the detokenizer cannot take) fails
that request alone: the frontend gets a :class:`RequestFailed`, the scheduler an abort, and the process goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from stride.config import StrideConfig
from stride.ipc import messages as m
from stride.ipc.queues import PullQueue, PushQueue
from stride.params import CONTEXT_LENGTH_EXCEEDED, context_overflow
from stride.tokenizer.detokenizer import token_bytes, token_bytes_table
from stride.tokenizer.loader import ModelTokenizer, load_tokenizer
from stride.tokenizer.stop import OutputText
from stride.tokenizer.template import ChatTemplate, TemplateError
from stride.tokenizer.tool_prompt import plain_messages, renders_tools

if TYPE_CHECKING:
    from stride.grammar.compile import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """One request's way back."""

    output: OutputText
    params: Any
    num_output_tokens: int = 0


class TokenizerWorker:
    """The message handling of one tokenizer process, separate from its sockets so tests can drive it."""

    def __init__(self, config: StrideConfig, index: int, tokenizer: ModelTokenizer) -> None:
        self.config = config
        self.index = index
        self.tok = tokenizer
        self.template = ChatTemplate.for_model(tokenizer) if tokenizer.chat_template else None
        self.renders_tools = renders_tools(tokenizer.chat_template or "")
        self.token_bytes = token_bytes_table(tokenizer.tokenizer)
        self._token_text = [b.decode("utf-8", errors="replace") for b in self.token_bytes]
        self.pending: dict[str, _Pending] = {}
        self._grammars: GrammarCompiler | None = None
        """Made at the first constrained request: llguidance is loaded only by a server that uses it."""

    # -------------------------------------------------------------- in

    def on_generate(self, req: m.GenerateRequest) -> m.TokenizedRequest | m.RequestFailed:
        """The request tokenized for the scheduler, or its refusal for the frontend. Token-id prompts were
        checked against the vocabulary by the frontend, which knows the model's."""
        try:
            ids = self._prompt_ids(req)
        except (TemplateError, ValueError) as e:
            return m.RequestFailed(req.req_id, 400, str(e), "invalid_prompt")
        except Exception as e:  # a tokenizer or template bug fails this request, not the process
            log.exception("tokenizer %d: request %s failed", self.index, req.req_id)
            return m.RequestFailed(req.req_id, 500, f"internal error: {type(e).__name__}", "internal_error")
        if not ids:
            return m.RequestFailed(req.req_id, 400, "the prompt is empty", "invalid_prompt")
        why = context_overflow(len(ids), req.params.max_tokens, self.config.scheduler.max_model_len)
        if why is not None:
            return m.RequestFailed(req.req_id, 400, why, CONTEXT_LENGTH_EXCEEDED)
        grammar = None
        if req.constraint is not None:
            try:
                grammar = self.grammars().compile(req.constraint)
            except ValueError as e:
                return m.RequestFailed(req.req_id, 400, str(e), "invalid_constraint")
            except ImportError as e:  # a broken install: structured outputs off, everything else served
                log.error("tokenizer %d: structured outputs unavailable: %s", self.index, e)
                return m.RequestFailed(req.req_id, 400, f"structured outputs are not available on this server "
                                       f"({e})", "invalid_constraint")
        self.pending[req.req_id] = _Pending(OutputText.create(self.token_bytes, req.params.stop), req.params)
        return m.TokenizedRequest(req.req_id, req.tenant, ids, req.params, self.index, req.service_class, grammar)

    def grammars(self) -> GrammarCompiler:
        """This process's grammar compiler and its cache (``ImportError`` without llguidance)."""
        if self._grammars is None:
            from stride.grammar.compile import GrammarCompiler

            self._grammars = GrammarCompiler()
        return self._grammars

    def _prompt_ids(self, req: m.GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            if self.template is None:
                raise ValueError("this model has no chat template; use /v1/completions")
            if self.renders_tools:
                text = self.template.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                            tools=req.tools)
            else:
                text = self.template.render(plain_messages(req.messages, req.tools),
                                            add_generation_prompt=req.add_generation_prompt)
            return self.tok.encode(text, add_special_tokens=False)
        return self.tok.encode(req.prompt or "")

    # -------------------------------------------------------------- out

    def on_outputs(self, outs: m.StepOutputs) -> tuple[list[m.TextDelta | m.RequestFailed], list[m.AbortRequest]]:
        deltas: list[m.TextDelta | m.RequestFailed] = []
        aborts: list[m.AbortRequest] = []
        for out in outs.outputs:
            p = self.pending.get(out.req_id)
            if p is None:  # released (client gone) or already stopped by a stop string
                continue
            if out.error is not None:
                del self.pending[out.req_id]
                deltas.append(m.RequestFailed(out.req_id, 500, out.error, "internal_error"))
                continue
            try:
                self._on_output(out, p, deltas, aborts)
            except Exception as e:  # this request's output cannot be turned into text: it alone fails
                log.exception("tokenizer %d: output of %s failed", self.index, out.req_id)
                self.pending.pop(out.req_id, None)
                deltas.append(m.RequestFailed(out.req_id, 500, f"internal error: {type(e).__name__}: {e}",
                                              "internal_error"))
                if out.finish_reason is None:
                    aborts.append(m.AbortRequest(out.req_id, reason="error"))
        return deltas, aborts

    def _on_output(self, out: m.TokenOutput, p: _Pending, deltas: list[m.TextDelta | m.RequestFailed],
                   aborts: list[m.AbortRequest]) -> None:
        text, stopped = p.output.push(out.token_ids)
        finish = out.finish_reason
        if stopped:
            finish = "stop"
            if out.finish_reason is None:
                aborts.append(m.AbortRequest(out.req_id, reason="stop"))
        elif finish is not None:
            tail, stopped_at_end = p.output.finish()
            text += tail
            finish = "stop" if stopped_at_end else finish
        if finish == "abort":
            del self.pending[out.req_id]
            return
        p.num_output_tokens += len(out.token_ids)
        deltas.append(m.TextDelta(
            out.req_id, text, list(out.token_ids), finish, out.num_prompt_tokens, out.num_cached_tokens,
            p.num_output_tokens, self._logprobs(out) if p.params.logprobs is not None else None))
        if finish is not None:
            del self.pending[out.req_id]

    def _logprobs(self, out: m.TokenOutput) -> list[dict[str, Any]] | None:
        if out.logprobs is None:
            return None
        entries = []
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=False)):
            top = out.top_logprobs[i] if out.top_logprobs is not None and i < len(out.top_logprobs) else []
            entries.append({
                "token": self._text_of(tok), "logprob": lp, "bytes": list(self._bytes_of(tok)),
                "top_logprobs": [{"token": self._text_of(int(t)), "logprob": float(v),
                                  "bytes": list(self._bytes_of(int(t)))} for t, v in top],
            })
        return entries

    def _bytes_of(self, token_id: int) -> bytes:
        return token_bytes(self.token_bytes, token_id)

    def _text_of(self, token_id: int) -> str:
        """As :meth:`_bytes_of`, from the decoded table (the two tables have one entry per id)."""
        return self._token_text[token_id] if token_bytes(self.token_bytes, token_id) else ""

    def on_release(self, msg: m.ReleaseRequest) -> None:
        self.pending.pop(msg.req_id, None)

    def on_abort(self, msg: m.AbortRequest) -> m.AbortRequest:
        """The client is gone: forget the request, and pass the abort on to the scheduler (which ignores it if
        the request never reached it: refused here, or already finished)."""
        self.pending.pop(msg.req_id, None)
        return msg


def run(config: StrideConfig, index: int) -> int:
    """Process entry point of tokenizer ``index``."""
    ctx = zmq.Context()
    control: PushQueue[m.Message] = PushQueue(ctx, config.ipc.control_address())
    try:
        worker = TokenizerWorker(config, index, load_tokenizer(config.worker.tokenizer or config.worker.model))
        inbox: PullQueue[m.Message] = PullQueue(ctx, config.ipc.tokenizer_address(index),
                                                m.TO_TOKENIZER + (m.Shutdown,))
        to_sched: PushQueue[m.Message] = PushQueue(ctx, config.ipc.scheduler_address())
        to_front: PushQueue[m.Message] = PushQueue(ctx, config.ipc.frontend_address())
        control.put(m.ProcessReady("tokenizer", index, vocab_size=worker.tok.vocab_size,
                                   eos_token_ids=list(worker.tok.eos_token_ids)))

        def generate(msg: m.GenerateRequest) -> None:
            reply = worker.on_generate(msg)
            (to_sched if isinstance(reply, m.TokenizedRequest) else to_front).put(reply)

        def outputs(msg: m.StepOutputs) -> None:
            deltas, aborts = worker.on_outputs(msg)
            for a in aborts:
                to_sched.put(a)
            texts = [d for d in deltas if isinstance(d, m.TextDelta)]
            for d in deltas:
                if not isinstance(d, m.TextDelta):
                    to_front.put(d)
            if texts:  # the step's text, one message for all of this tokenizer's requests
                to_front.put(texts[0] if len(texts) == 1 else m.TextDeltas(texts))

        handlers: dict[type, Callable[[Any], None]] = {
            m.GenerateRequest: generate,
            m.StepOutputs: outputs,
            m.AbortRequest: lambda msg: to_sched.put(worker.on_abort(msg)),
            m.ReleaseRequest: worker.on_release,
        }
        while not isinstance(msg := inbox.get(), m.Shutdown):
            handlers[type(msg)](msg)
        return 0
    except Exception as e:
        log.exception("tokenizer %d failed", index)
        control.put(m.ProcessFailed("tokenizer", f"{type(e).__name__}: {e}", index))
        return 1
    finally:
        ctx.destroy(linger=200)
