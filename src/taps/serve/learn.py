"""`taps serve --learn DIR`: what the server keeps of its own answers, and the lookup drafter that
reads them back.

    DIR/log/     every finished chat answer, as `taps data regenerate` records (serve/answer_log.py)
    DIR/store/   the online datastore of those answers (serve/online_store.py)
    DIR/heads/   adapted head versions, picked up between requests (serve/swap.py)

Nothing is kept without --learn, and nothing of a request that says `extra_body.taps.learn =
false`. Kept: chat requests whose decode finished (a stop token, the token limit or a stop string);
not kept: completions (the log's shape is chat records), cancelled or cut decodes, errors.

Why a thread: fsync'ing the log and re-indexing the store take milliseconds to seconds; the
learner thread does both after the answer has gone out, one answer after another, so the decoder
never waits on the disk. Answers that arrive while it indexes are indexed together (one rebuild).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from taps.data.chat import special_ids
from taps.propose.lookup import LookupSpec
from taps.propose.spec import LOOKUP
from taps.serve.answer_log import AnswerLog, read_log
from taps.serve.online_store import OnlineStore, answer_segment

LOG = logging.getLogger("taps.serve")
LOGGED_FINISHES = ("stop_token", "max_new_tokens", "stop_string")


@dataclass
class Answer:
    """One finished request, as the learner needs it."""

    id: str
    messages: list[dict] | None  # the chat request's messages (None: a completion, not logged)
    prompt: list[int]
    tokens: list[int]  # the emitted tokens
    reply: str
    finish: str
    served: dict = field(default_factory=dict)  # model, variant, sampling


def log_record(answer: Answer) -> dict:
    """The answer as a `taps data regenerate` record (serve/answer_log.py)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in answer.messages]
    return {"id": answer.id, "source": "taps-serve",
            "conversations": [*messages, {"role": "assistant", "content": answer.reply}],
            "regenerated": {"original_turns": len(messages) + 1, "stop_reasons": [answer.finish],
                            "new_tokens": len(answer.tokens)},
            "served": {"time": round(time.time(), 3), **answer.served, "prompt_tokens": len(answer.prompt),
                       "answer_tokens": list(answer.tokens)}}


class Learner:
    """The log and the online store of one server, written by one thread."""

    def __init__(self, root: str | Path, engine, max_log_bytes: int = 256 << 20, max_file_bytes: int = 16 << 20,
                 store_tokens: int = 2_000_000, persist_every_s: float = 30.0):
        self.root, self.engine = Path(root), engine
        tokenizer = engine.target.tokenizer
        self.special = special_ids(tokenizer)
        self.log = AnswerLog(self.root, max_file_bytes, max_log_bytes)
        self.store = OnlineStore(self.root, engine.target, store_tokens, persist_every_s,
                                 {"target": engine.model_id, "tokenizer_fingerprint": engine.target.fingerprint(),
                                  "chat_template": bool(getattr(tokenizer, "chat_template", None))})
        source = self.store.load(self._logged_segments())
        self._publish()
        LOG.info(f"taps serve --learn: {self.root} (store: {len(self.store.segments)} answers, "
                 f"{self.store.tokens} tokens, from {source})")
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="taps-learn")
        self.thread.start()

    def _logged_segments(self):
        for record in read_log(self.root):
            served = record.get("served") or {}
            tokens = served.get("answer_tokens")
            if isinstance(tokens, list) and record.get("conversations"):
                prompt = self.engine.chat_prompt(record["conversations"][:-1])
                yield answer_segment(prompt, tokens, self.special)

    def _publish(self) -> None:
        """The lookup member of every variant from now on: prompt lookup, then the new snapshot."""
        self.engine.pool.replace(LOOKUP, LookupSpec(datastore=self.store.snapshot))

    # ---- the server's side ---------------------------------------------------------------------
    def submit(self, answer: Answer) -> None:
        """Called after a request finished (any thread): kept if it finished (module docstring)."""
        if answer.finish in LOGGED_FINISHES:
            self.queue.put(answer)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every answer submitted so far is logged and published (tests, shutdown). After
        close() the thread is gone and everything was already kept: nothing to wait for."""
        if not self.thread.is_alive():
            return
        done = threading.Event()
        self.queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        """Idempotent: the server's shutdown closes it, and a caller holding it may close it again."""
        if not self.thread.is_alive():
            return
        self.flush()
        self.queue.put(None)
        self.thread.join(30)
        self.store.persist(force=True)

    # ---- the learner thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            items = [self.queue.get()]
            while True:  # everything already waiting goes into one rebuild
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            answers = [a for a in items if isinstance(a, Answer)]
            try:
                self._learn(answers)
            except Exception:  # the server goes on; the answer is lost to learning only
                LOG.exception("taps serve --learn: could not keep %d answer(s)", len(answers))
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is None for item in items):
                return

    def _learn(self, answers: list[Answer]) -> None:
        for answer in answers:
            if answer.messages is not None:
                self.log.append(log_record(answer))
        segments = [answer_segment(a.prompt, a.tokens, self.special) for a in answers if a.messages is not None]
        if segments:
            self.store.add(segments)
            self.store.publish()
            self._publish()
        self.store.persist()
