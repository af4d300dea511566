"""Wire messages: every type round-trips; malformed frames are rejected, logged, and never raise in a loop."""

from __future__ import annotations

import dataclasses
import logging

import orjson
import pytest

from stride.ipc import messages as m
from stride.ipc.codec import DecodeError, Decoder, encode
from stride.params import Constraint, SamplingParams

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, stop=("\n\n", "END"), seed=11, logprobs=2)

EXAMPLES: list[m.Message] = [
    m.GenerateRequest("r1", "acme", PARAMS, prompt="hi"),
    m.GenerateRequest("r2", "acme", PARAMS, messages=[{"role": "user", "content": "hi"}], service_class="batch"),
    m.GenerateRequest("r3", "t", SamplingParams(), prompt_token_ids=[1, 2, 3]),
    m.StepOutputs([m.TokenOutput("r1", [5, 6], "length", 3, 0, [-0.5, -1.0], [[[5, -0.5]], [[6, -1.0]]])]),
    m.ReleaseRequest("r1"),
    m.TokenizedRequest("r1", "acme", [1, 2, 3], PARAMS, tokenizer_index=1, service_class="interactive"),
    m.TokenizedRequest("r4", "t", [1], PARAMS, tokenizer_index=0, grammar='start: "a"'),
    m.AbortRequest("r1", reason="stop"),
    m.StepDone(41),
    m.StepDone(42, error="boom"),
    m.StepDescriptor(3, 2, 17, [m.NewSequence(0, "r1", PARAMS, 16)], finished_slots=[4, 5]),
    m.StepDescriptor(4, 2, 2, masked_rows=[1]),
    m.MasksReady(4),
    m.Shutdown("bye"),
    m.TextDelta("r1", "héllo 🙂", [1, 2], "stop", 3, 1, 2, [{"token": "h", "logprob": -0.1}]),
    m.RequestFailed("r1", 429, "queue full", "queue_full"),
    m.ProcessReady("worker", 0, num_blocks=12, vocab_size=320),
    m.Progress("worker", "loading", 0.5),
    m.ProcessFailed("worker", "cuda oom", 1),
    m.Heartbeat("worker", 2),
    m.SchedulerStats(3, 4, 10, 5, 1, 2),
    m.ClientGenerate("c1", "key", prompt="hi", params={"max_tokens": 3, "stop": ["x"]}),
    m.ClientAbort("c1"),
    m.ClientOutput("c1", "hi", [1], "stop", 1, 0, 1, None, 200, None),
    m.GenerateRequest("r4", "t", SamplingParams(), prompt="x", constraint=Constraint("regex", "[0-9]+")),
    m.TextDeltas([m.TextDelta("r1", "a", [1]), m.TextDelta("r2", "b", [2], "stop", 3, 0, 1)]),
]


def test_every_message_type_has_an_example() -> None:
    assert {type(x) for x in EXAMPLES} == set(m.ALL_MESSAGES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg: m.Message) -> None:
    decoder = Decoder(m.ALL_MESSAGES)
    back = decoder.decode(encode(msg))
    assert back == msg
    assert type(back) is type(msg)


def test_decoders_accept_only_their_group() -> None:
    to_worker = Decoder(m.TO_WORKER)
    with pytest.raises(DecodeError, match="unknown message tag"):
        to_worker.decode(encode(m.AbortRequest("r1")))


def _frame(msg: m.Message, **changes: object) -> bytes:
    body = orjson.loads(encode(msg))
    body.update(changes)
    return orjson.dumps({k: v for k, v in body.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize("frame,why", [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "tagged object"),
    (b'{"t": 5}', "tagged object"),
    (b'{"t": "nope"}', "unknown message tag"),
    (_frame(m.StepDone(1), step="1"), "expected int"),
    (_frame(m.StepDone(1), step=True), "expected int"),
    (_frame(m.StepDone(1), step=_DROP), "missing field"),
    (_frame(m.StepDone(1), extra=1), "unknown fields"),
    (_frame(EXAMPLES[5], prompt_token_ids=[1, "2"]), "expected int"),
    (_frame(EXAMPLES[5], params={"temperature": -1.0}), "temperature"),
    (_frame(EXAMPLES[5], params=[1]), "SamplingParams object"),
])
def test_malformed_frames_are_rejected(frame: bytes, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        Decoder(m.ALL_MESSAGES).decode(frame)


def test_decode_or_log_logs_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    decoder = Decoder(m.ALL_MESSAGES)
    with caplog.at_level(logging.ERROR):
        assert decoder.decode_or_log(b'{"t": "step_done", "step": "x"}') is None
    assert "dropped malformed frame" in caplog.text
    # Negative control: a good frame is not logged.
    caplog.clear()
    assert decoder.decode_or_log(encode(m.StepDone(1))) == m.StepDone(1)
    assert "dropped" not in caplog.text


def test_sampling_params_survive_as_tuples() -> None:
    back = Decoder(m.ALL_MESSAGES).decode(encode(EXAMPLES[0]))
    assert isinstance(back, m.GenerateRequest)
    assert back.params.stop == ("\n\n", "END")
    assert dataclasses.asdict(back.params) == dataclasses.asdict(PARAMS)


def test_duplicate_tags_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Decoder([m.StepDone, m.StepDone])
