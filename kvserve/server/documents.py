"""`POST /v1/kvserve/compress`: compress a document once, ahead of its questions ("compress once, ask many").

The body names the document as `prompt` (text or token ids) or `messages` (a chat's first messages, rendered by the
model's chat template without a generation prompt), plus the usual `kv_*` settings (body keys or `x-kv-*` headers;
`kv_policy` defaults to `kvzip`, `kv_budget` is the entries each layer and KV head keeps of the document). The route
sends the engine one completion whose prompt is the document, KVzip's repeat instruction and the document again
(`kv_document=N`, `kv_reconstruct`): the engine compacts the document's entries by the model's reconstruction of it
and publishes them in the prefix cache (`kvserve/core/checkpoints.py`). A document longer than one piece
(RECONSTRUCTION_PIECE tokens, or what max_model_len leaves beside the document) is reconstructed piece by piece, one
completion per piece of the copy, run in order; the last one compacts with every piece's scores
(`kvserve/worker/pieces.py`), so any document that fits max_model_len with a short piece beside it compresses. It
answers with the document's token count, the time it took, and the `kv` settings to send with every request that
starts with the document: those resume from the compressed lists (their `usage.kv_tokens_evicted` says how many of
the document's tokens were left out; 0 means the compressed document was gone from the cache and the request was
served in full).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config import INTERNAL_KEYS
from kvserve.errors import InvalidSetting
from kvserve.model_support import ServedEngine, model_tokenizer, served_settings
from kvserve.policies import POLICIES
from kvserve.policies.kvzip import REPEAT_INSTRUCTION
from kvserve.server.paths import COMPRESS_PATH

# tokens of the copy each reconstruction request repeats: the paper's pieces (arXiv:2505.23416, section 3.2)
RECONSTRUCTION_PIECE = 2048
CONTINUE_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
# fewer tokens a piece would take more requests than the document's own prefill is worth
MIN_PIECE = 128
PIECE_OVERLAP = 8  # the previous piece's last tokens a later piece's instruction quotes, as the authors' code does
# what vLLM's chat rendering would read and this module's own rendering would not
CHAT_FIELDS_NOT_RENDERED = ("tools", "chat_template", "chat_template_kwargs", "continue_final_message", "documents")
SET_HERE = ("kv_document", *INTERNAL_KEYS)  # the route sets these itself


def tokenizer_of(engine: ServedEngine):
    model = engine.model_config
    return model_tokenizer(model.tokenizer, bool(model.trust_remote_code))


def document_ids(body: dict[str, Any], tokenizer) -> list[int]:
    """The document's tokens as a later request's prompt starts with them: text tokenized as vLLM tokenizes a
    completion's prompt (special tokens added), messages rendered as a chat's first turns."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidSetting("prompt", "give the document as prompt (text or token ids) or as messages, one of them")
    if isinstance(prompt, str) and prompt:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) and token >= 0 for token in prompt):
        return list(prompt)
    if prompt is not None:
        raise InvalidSetting("prompt", "must be a non-empty string or a non-empty list of token ids")
    return chat_ids(messages, tokenizer, reply=False, instead="give the document as prompt")


def chat_ids(messages: Any, tokenizer, reply: bool, instead: str = "") -> list[int]:
    """Chat messages rendered by the model's template (with the start of the reply when `reply`); InvalidSetting
    names `messages` when they are not a chat or the model has no template (`instead`: what to send then)."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise InvalidSetting("messages", "must be a non-empty list of chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidSetting("messages", "this model has no chat template" + (f": {instead}" if instead else ""))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=reply, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def prompt_ids(body: dict[str, Any], path: str, tokenizer, setting: str) -> list[int]:
    """A generation request's prompt tokens as vLLM will see them (one prompt; a chat rendered with its generation
    prompt), for a `setting` that needs them before the engine does; InvalidSetting names what cannot be read."""
    if path == "/v1/chat/completions":
        for field in CHAT_FIELDS_NOT_RENDERED:
            if body.get(field) is not None:
                raise InvalidSetting(field, f"{setting} renders the chat itself to read its prompt")
        return chat_ids(body.get("messages"), tokenizer, reply=True)
    raw = body.get("prompt")
    if not isinstance(raw, str) and not (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raise InvalidSetting("prompt", f"{setting} reads one prompt's tokens: send one prompt")
    return document_ids({"prompt": raw}, tokenizer)


def reply_start(tokenizer) -> str:
    """What follows the instruction: a chat model's end of a user turn and start of the reply, or a blank line."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n"
    marker = "\x00kvzip\x00"
    turn = [{"role": "user", "content": marker}]
    rendered = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    return rendered.partition(marker)[2]  # "<|im_end|>\n<|im_start|>assistant\n"


def instruction_ids(tokenizer) -> list[int]:
    """KVzip's repeat instruction, then (a chat model) its template's end of a user turn and start of the reply."""
    return list(tokenizer.encode(REPEAT_INSTRUCTION + reply_start(tokenizer), add_special_tokens=False))


@dataclass(frozen=True)
class Piece:
    """One request of a document's reconstruction: its prompt copies the document's tokens start..end."""

    prompt: list[int]
    start: int
    end: int


def reconstruction_pieces(
    document: list[int], tokenizer, max_model_len: int, piece_tokens: int = RECONSTRUCTION_PIECE
) -> list[Piece]:
    """The requests that reconstruct `document`: each is the document, an instruction and one piece of at most
    `piece_tokens` of its copy (fewer where the document leaves less room below max_model_len); one request when
    the whole copy is one piece. InvalidSetting names `prompt` when the document leaves room for pieces of fewer than
    MIN_PIECE tokens."""
    first = instruction_ids(tokenizer)
    # a later piece's instruction: repeat the part after the quoted tokens (the previous piece's last ones), then the
    # start of the reply; its two fixed parts tokenized once for every piece
    repeat_part = list(tokenizer.encode(CONTINUE_INSTRUCTION, add_special_tokens=False))
    reply = list(tokenizer.encode(reply_start(tokenizer), add_special_tokens=False))
    longest = max(len(first), len(repeat_part) + min(PIECE_OVERLAP, len(document)) + len(reply))
    room = max_model_len - 1 - len(document) - longest
    if room < min(MIN_PIECE, len(document)):
        raise InvalidSetting(
            "prompt",
            f"the document's {len(document)} tokens leave room for pieces of {max(room, 0)} tokens below "
            f"max_model_len ({max_model_len}) beside its reconstruction's instruction; at least {MIN_PIECE} are needed",
        )
    size = min(piece_tokens, room)
    pieces = []
    for start in range(0, len(document), size):
        end = min(start + size, len(document))
        quoted = document[max(start - PIECE_OVERLAP, 0) : start]
        instruction = first if start == 0 else repeat_part + quoted + reply
        pieces.append(Piece(document + instruction + document[start:end], start, end))
    return pieces


def compress_request(body: dict[str, Any], engine: ServedEngine) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """(the engine completions to run in order, one per piece of the reconstruction; the settings a question sends;
    the document's tokens); InvalidSetting names the field of a request that cannot be served."""
    xargs = dict(body.get("vllm_xargs") or {})
    for key in SET_HERE:
        if key in xargs:
            raise InvalidSetting(key, f"is set by {COMPRESS_PATH} itself")
    xargs.setdefault("kv_policy", "kvzip")
    policy = POLICIES.get(str(xargs["kv_policy"]))
    if policy is None or not policy.reconstructs:
        names = ", ".join(name for name, cls in POLICIES.items() if cls.reconstructs)
        raise InvalidSetting("kv_policy", f"{COMPRESS_PATH} scores the document by its reconstruction: one of {names}")
    tokenizer = tokenizer_of(engine)
    document = document_ids(body, tokenizer)
    pieces = reconstruction_pieces(document, tokenizer, engine.model_config.max_model_len)
    question_settings = {**xargs, "kv_document": len(document)}
    served_settings(question_settings, engine)  # what its questions send must be servable too
    key = uuid.uuid4().hex  # where the pieces' scores meet in the workers (kvserve/worker/pieces.py)
    completions = []
    for piece in pieces:
        piece_settings = {**question_settings, "kv_reconstruct": "true"}
        if len(pieces) > 1:
            piece_settings["kv_reconstruct_piece"] = f"{key}:{piece.start}:{piece.end}"
        completion = {
            "prompt": piece.prompt,
            "max_tokens": 1,  # nothing is generated: the last piece's compaction publishes the document
            "temperature": 0,
            "vllm_xargs": piece_settings,
        }
        for passed in ("model", "cache_salt"):  # a salt keeps a tenant's documents to its own requests
            if passed in body:
                completion[passed] = body[passed]
        completions.append(completion)
    return completions, question_settings, len(document)


def compress_response(completion: bytes, question_settings: dict[str, Any], tokens: int, seconds: float) -> bytes:
    """The route's answer, from the engine completion's."""
    answer = json.loads(completion)
    usage = answer.get("usage") or {}
    return json.dumps(
        {
            "object": "kvserve.compressed_document",
            "model": answer.get("model"),
            "document_tokens": tokens,
            "kv_tokens_evicted": usage.get("kv_tokens_evicted", 0),
            "compress_seconds": round(seconds, 3),
            "kv": {key: _plain(value) for key, value in question_settings.items()},
        }
    ).encode()


def _plain(value: Any) -> Any:
    """A header's text as the JSON value a client would have sent ("64" -> 64)."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


class Collected:
    """An ASGI `send` that keeps the response (the engine completion's) instead of sending it."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


async def reconstruct(
    run: Callable[[dict, Any], Awaitable[Collected]], completions: list[dict], configs: list[Any]
) -> Collected:
    """A document's reconstruction, piece by piece in order (each piece's scores must be in before the last one
    compacts): the first failed piece's response, or the last one's."""
    for completion, config in zip(completions, configs, strict=True):
        collected = await run(completion, config)
        if collected.status != 200:
            return collected
    if not (json.loads(collected.body).get("usage") or {}).get("kv_tokens_evicted"):
        # the last piece did not compact (a worker failed it in the step it also finished in): nothing published
        message = "the document's reconstruction ended without compacting it; nothing was published"
        collected.status = 500
        collected.body = json.dumps(
            {"error": {"message": message, "type": "InternalServerError", "code": 500}}
        ).encode()
    return collected
